"""The LLM-API layout of a decoder: one ``tensorrt_llm`` python-backend model driving TensorRT-LLM's LLM API.

From the first TensorRT-LLM release without the TensorRT engine backend, ``--target tensorrtllm`` writes no
engine: the Hugging Face checkpoint goes into ``tensorrt_llm/1/hf`` (the LLM API loads it directly; a
quantized build stores nvidia-modelopt's unified Hugging Face checkpoint there), ``1/model.yaml`` holds the
LLM API's arguments (each key a declared ``-o`` option of the profile, or a build flag) and its
``triton_config``, ``1/model.py`` is forge's own model on the public LLM API, and ``config.pbtxt`` is the
profile's interface tensor by tensor, then forge's optional additions (:func:`extension_io`: token-id prompts,
log-probs, token counts). Clients send text (``text_input``) and get text back; there is no preprocessing,
postprocessing or ensemble.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from forge import in_triton
from forge import tritonconfig as tc
from forge.components import Artifact, Component, TritonModel
from forge.errors import UsageError
from forge.in_triton.forge_glue import TOKENIZER_FILES

from ..profiles import Profile
from .interface import LLM, tensorrt_llm_io, truthy

CHECKPOINT_DIR = "hf"  # tensorrt_llm/1/hf: model.yaml's ``model`` (relative to the model's version directory)
ARTIFACT_KIND = "hf-checkpoint"
_HF_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "hf_quant_config.json")
# build limits written to model.yaml only when given: left out, the LLM API sizes them for the GPU it runs on
_LIMITS = ("max_batch_size", "max_seq_len", "max_input_len", "max_num_tokens")


def export(adapter, source: Path, ctx) -> Artifact:
    """The export stage of the LLM-API layout: the checkpoint as it is, checked (config, parallelism, every
    tensor's name, dtype and shape) and described for the later stages; nothing is converted."""
    from forge.hf import inspect_checkpoint

    from .checkpoint import checkpoint_meta, convert_checkpoint

    spec = ctx.spec
    source = Path(source)
    checkpoint = inspect_checkpoint(source, allow_pickle=False, trust_remote_code=spec.trust_remote_code)
    if checkpoint.weight_format != "safetensors":
        raise UsageError(f"{source} has only pickle weights; TensorRT-LLM's LLM API is given safetensors only",
                         hint="convert the checkpoint to safetensors first")
    config = dict(checkpoint.config)
    norm = convert_checkpoint(adapter, config, checkpoint.weight_files, ctx.workdir / "unused", dtype=spec.dtype,
                              tp=spec.tp, pp=spec.pp, where=str(source), log=ctx.log, write=False)
    meta = checkpoint_meta(adapter, norm, (config.get("architectures") or [""])[0], spec.dtype, spec.tp, spec.pp,
                           source)
    meta["format"] = "hf"
    meta["files"] = sorted(p.name for p in checkpoint.weight_files)
    ctx.note("export", {"format": "Hugging Face checkpoint (the LLM API loads it as it is)",
                        "architecture": meta["hf_architecture"], "tp": spec.tp, "pp": spec.pp})
    return Artifact(ARTIFACT_KIND, source, meta)


def extension_io() -> tuple[list, list]:
    """forge's optional additions to the LLM-API interface (``forge_llmapi.EXTENSION_INPUTS`` / ``_OUTPUTS``) as
    config tensors; both targets' ``tensorrt_llm`` model declares and serves them (TensorRT-LLM's clients never
    send them)."""
    from forge.in_triton.forge_llmapi import EXTENSION_INPUTS, EXTENSION_OUTPUTS

    return ([tc.model_input(name, kind, [dim], optional=True) for name, kind, dim in EXTENSION_INPUTS],
            [tc.model_output(name, kind, [dim]) for name, kind, dim in EXTENSION_OUTPUTS])


def checkpoint_files(directory: Path, weights: list[str]) -> dict[str, Path]:
    """``1/hf/…`` → the files the LLM API loads: config, weights, tokenizer (linked, not copied)."""
    names = dict.fromkeys([*_HF_FILES, *TOKENIZER_FILES, *weights])
    return {f"1/{CHECKPOINT_DIR}/{name}": directory / name for name in names if (directory / name).is_file()}


def _set(doc: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        doc = doc.setdefault(part, {})
    doc[last] = value


def _typed(value: Any, kind: str) -> Any:
    if kind == "bool":
        return truthy(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    return str(value)


def model_yaml(spec, profile: Profile, *, decoupled: bool, multimodal: bool = False,
               lora: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``1/model.yaml``: the LLM API's arguments from the build spec, then ``triton_config``.

    Every key is one the profile declares (:meth:`Profile.yaml_keys`); -o options set the settable ones.
    """
    doc: dict[str, Any] = {"model": CHECKPOINT_DIR, "tensor_parallel_size": spec.tp,
                           "pipeline_parallel_size": spec.pp}
    if spec.dtype_given:
        doc["dtype"] = spec.dtype
    if spec.trust_remote_code:
        doc["trust_remote_code"] = True
    for name in _LIMITS:
        if name in spec.limits.given:
            doc[name] = getattr(spec.limits, name)
    if spec.limits.max_beam_width > 1:
        doc["max_beam_width"] = spec.limits.max_beam_width
    declared = {p.key: p for p in profile.yaml_keys()}
    for p in declared.values():
        if not p.fixed and p.name in spec.options:
            _set(doc, p.key, _typed(spec.options[p.name], p.kind))
    if lora:
        _set(doc, "lora_config.lora_dir", [f"lora/{name}" for name in lora["adapters"]])
        _set(doc, "lora_config.lora_target_modules", list(lora["modules"]))
        doc.setdefault("lora_config", {}).setdefault("max_lora_rank", lora["max_rank"])
    elif "lora_config" in doc:
        raise UsageError(f"-o {', '.join(sorted(doc['lora_config']))}: LoRA limits without --lora adapters",
                         hint="ship adapters with --lora NAME=DIR, or drop the option")
    triton: dict[str, Any] = {"max_batch_size": 0, "decoupled": decoupled}
    if multimodal:
        triton["multimodal"] = True
    doc["triton_config"] = {**doc.get("triton_config", {}), **triton}
    undeclared = sorted(k for k in _paths(doc) if k not in declared)
    if undeclared:  # forge's own mistake, never the user's: the profile is the list of keys
        raise AssertionError(f"model.yaml keys the profile {profile.version} does not declare: {undeclared}")
    return doc


def _paths(doc: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted key paths of ``doc`` (sections the profile declares as a whole stay one key)."""
    found = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found += _paths(value, f"{path}.")
        else:
            found.append(path)
    return found


def dump_yaml(doc: Mapping[str, Any], profile: Profile) -> str:
    import yaml

    head = (f"# TensorRT-LLM LLM API arguments (LLM(**args) without triton_config), written by forge for "
            f"{profile.version}.\n# Relative paths are the model directory's own (tensorrt_llm/1/).\n")
    return head + yaml.safe_dump(dict(doc), sort_keys=False)


#: --quant modes the PyTorch backend loads from nvidia-modelopt's unified Hugging Face checkpoint
#: (``hf_quant_config.json`` quant_algo), with what it is written as
QUANTS = {"int4_awq": "W4A16_AWQ", "fp8": "FP8"}
#: the modes it does not, and why (read from the release's quantization loaders)
NOT_LOADED = {
    "w8a16": "nvidia-modelopt's unified Hugging Face export writes no INT8 weight-only checkpoint for it",
    "w4a16": "nvidia-modelopt's unified Hugging Face export writes no INT4 per-channel weight-only checkpoint "
             "for it (int4_awq is the INT4 mode it loads)",
    "int8_kv": "its KV cache takes fp8 or nvfp4 (kv_cache_config.dtype), not INT8",
}


_ENGINE_BUILD = "builds no TensorRT engine on this layout (there is no trtllm-build)"
_TEXT_MODELS = "sets forge's preprocessing / postprocessing / BLS models, which this layout does not have"
_LLM_TOKENIZES = "is decided by the LLM API's own tokenizer and generation config on this layout"
#: forge's own -o options that change nothing on the LLM-API layout, by target, and why (refused, never ignored)
NO_EFFECT: Mapping[str, Mapping[str, str]] = {
    "tensorrtllm": {
        **{o: _ENGINE_BUILD for o in ("context_fmha", "paged_context_fmha", "multiple_profiles", "workers",
                                      "trtllm_build_args", "parity", "parity_tolerance", "logits_datatype",
                                      "prompt_embedding_table_data_type", "encoder_input_features_data_type")},
        **{o: _TEXT_MODELS for o in ("preprocessing_instance_count", "postprocessing_instance_count",
                                     "bls_instance_count", "max_queue_delay_microseconds", "max_queue_size")},
        **{o: _LLM_TOKENIZES for o in ("add_special_tokens", "skip_special_tokens", "end_id", "pad_id",
                                       "stop_token_ids", "exclude_input_in_output")},
    },
    "python": {**{o: _TEXT_MODELS for o in ("preprocessing_instance_count", "postprocessing_instance_count",
                                            "bls_instance_count")},
               **{o: "tunes Triton's dynamic batcher, which a model without a batch dimension (the LLM-API "
                     "interface's) does not use" for o in ("max_queue_delay_microseconds", "max_queue_size")},
               "exclude_input_in_output": "is each request's sampling_param_exclude_input_from_output on this "
                                          "interface"},
}


def check_spec(spec, profile: Profile, target: str, adapter) -> None:
    """What the LLM-API layout cannot take (before any stage runs)."""
    for option, why in NO_EFFECT.get(target, {}).items():
        if option in spec.options:
            raise UsageError(f"-o {option} {why} (TensorRT-LLM {profile.version}, --target {target})",
                             hint="drop it, or build --backend-version 1.2.1 for the engine layout")
    if truthy(spec.options.get("bls", False)):
        raise UsageError(f"-o bls=true: TensorRT-LLM {profile.version} has no tensorrt_llm_bls model (its "
                         "tensorrt_llm model takes text itself)", hint="drop -o bls, or build --backend-version 1.2.1")
    if target != "tensorrtllm":
        return
    instances = spec.options.get("instances")
    if instances is not None and int(instances) > 1:
        raise UsageError(f"the LLM-API tensorrt_llm model of {profile.version} runs one instance that drives every "
                         f"GPU of its world; --instances {instances} is not supported", hint="drop --instances")
    for mode in spec.quant:
        if mode in NOT_LOADED:
            raise UsageError(f"--quant {mode}: TensorRT-LLM {profile.version}'s PyTorch backend cannot load it "
                             f"({NOT_LOADED[mode]})",
                             hint=f"use --quant {' or '.join(QUANTS)}, or build --backend-version 1.2.1 (engines)")
    if len([m for m in spec.quant if m in QUANTS]) > 1:
        raise UsageError(f"--quant {','.join(spec.quant)}: choose one weight format ({' or '.join(QUANTS)})")
    if spec.options.get("lora"):
        from .lora_format import check_llmapi_modules

        check_llmapi_modules(adapter, spec, profile)


def quantize(adapter, source: Path, artifact: Artifact, ctx) -> Artifact | None:
    """``--quant`` on the LLM-API layout: the model calibrated with nvidia-modelopt and written as its unified
    Hugging Face checkpoint (``hf_quant_config.json`` beside the weights), which the PyTorch backend loads."""
    import contextlib
    import shutil
    import sys
    from dataclasses import asdict

    from . import weight_quant

    spec = ctx.spec
    meta = dict(artifact.meta)
    recipe = weight_quant.make_recipe(spec.quant, meta, spec.options)
    ctx.note("quantize", asdict(recipe))
    if ctx.dry_run:
        return None
    texts = weight_quant.calibration_texts(spec.options.get("calib_data"), recipe.calibration["samples"])
    recipe.calibration["samples"] = len(texts)
    out = ctx.workdir / CHECKPOINT_DIR
    ctx.log(f"calibrating with nvidia-modelopt on {len(texts)} samples ({', '.join(recipe.modes)})")
    with contextlib.redirect_stdout(sys.stderr):  # modelopt prints progress; stdout is for --json
        import torch
        from modelopt.torch.export import export_hf_checkpoint

        model, tokenizer = weight_quant.load_for_calibration(Path(source), spec)
        weight_quant.calibrate(model, tokenizer, recipe, texts)
        export_hf_checkpoint(model, dtype=getattr(torch, spec.dtype), export_dir=out)
    del model
    written = out / "hf_quant_config.json"
    if not written.is_file():
        raise UsageError(f"nvidia-modelopt wrote no hf_quant_config.json for --quant {','.join(spec.quant)}")
    import json

    algo = (json.loads(written.read_text()).get("quantization") or {}).get("quant_algo")
    if algo != recipe.quant_algo:
        raise UsageError(f"nvidia-modelopt exported {algo} weights, but --quant {','.join(spec.quant)} asks for "
                         f"{recipe.quant_algo}")
    for name in TOKENIZER_FILES:  # the tokenizer travels with the checkpoint the LLM API loads
        if (Path(source) / name).is_file() and not (out / name).exists():
            shutil.copy2(Path(source) / name, out / name)
    meta["files"] = sorted(p.name for p in out.glob("*.safetensors")) + (
        ["model.safetensors.index.json"] if (out / "model.safetensors.index.json").is_file() else [])
    meta["quant"] = {"quant_algo": algo, "modes": list(recipe.modes), "method": "nvidia-modelopt unified HF checkpoint",
                     "calibration": recipe.calibration}
    ctx.note("quantize", {**asdict(recipe), "method": meta["quant"]["method"]})
    return Artifact(ARTIFACT_KIND, out, meta)


def emit(adapter, component: Component, artifact: Artifact, ctx, profile: Profile) -> TritonModel:
    """The LLM-API ``tensorrt_llm`` model of ``component`` (``--target tensorrtllm``)."""
    spec = ctx.spec
    check_spec(spec, profile, "tensorrtllm", adapter)
    decoupled = truthy(ctx.option("decoupled", True))  # streaming by default; non-streamed requests alike
    inputs, outputs = tensorrt_llm_io(profile, spec, artifact.meta)
    extra_inputs, extra_outputs = extension_io()
    inputs, outputs = inputs + extra_inputs, outputs + extra_outputs
    name = component.model_name(LLM)
    lora = component.options.get("lora")
    doc = model_yaml(spec, profile, decoupled=decoupled, lora=_lora_yaml(adapter, lora) if lora else None)
    parameters = {"forge_layout": "llmapi", "forge_target": "tensorrtllm", "tokenizer_dir": CHECKPOINT_DIR}
    config = tc.model_config(name, backend="python", max_batch_size=0, inputs=inputs, outputs=outputs,
                             parameters=parameters, instances=1, instance_kind="KIND_CPU", decoupled=decoupled)
    source = Path(artifact.path)
    files: dict[str, Path | bytes | str] = {
        "1/model.py": in_triton.LLMAPI_MODEL.read_bytes(), "1/forge_llmapi.py": in_triton.LLMAPI.read_bytes(),
        **in_triton.glue_files(), "1/model.yaml": dump_yaml(doc, profile),
        **checkpoint_files(source, list(artifact.meta.get("files", []))), **(lora_files(lora) if lora else {})}
    ctx.note("llmapi", {"model_yaml": doc, "checkpoint": CHECKPOINT_DIR})
    if lora:  # the front and forge infer find the adapters here: lora_name, lora_id (task id), lora_path
        ctx.note("lora", {"model": name, "adapters": [
            {"name": n, "task_id": e["task_id"], "rank": e["rank"], "modules": e["modules"], "path": f"lora/{n}",
             "llmapi": True, "source": e["source"], "sha256": e["sha256"]} for n, e in lora.items()]})
    return TritonModel(config, files)


def _lora_yaml(adapter, lora: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """model.yaml's ``lora_config`` for the shipped adapters (``--lora``: name → summary): their folders, the
    TensorRT-LLM modules they patch and the largest rank."""
    from .lora_format import build_modules

    return {"adapters": list(lora), "modules": build_modules([e["modules"] for e in lora.values()]),
            "max_rank": max(int(e["rank"]) for e in lora.values())}


def lora_files(lora: Mapping[str, Mapping[str, Any]]) -> dict[str, Path]:
    """``1/lora/<name>/…`` → the PEFT adapter's own files (config and safetensors), which LoRARequest loads."""
    files = {}
    for name, entry in lora.items():
        source = Path(entry["source"])
        for path in sorted(source.iterdir()):
            if path.is_file() and (path.name == "adapter_config.json" or path.suffix == ".safetensors"):
                files[f"1/lora/{name}/{path.name}"] = path
    return files
