"""``--target vllm``: the model directory Triton's vLLM backend loads, written from the build spec.

One model (named like the decoder's entry point, ``<prefix>ensemble``): ``config.pbtxt`` with
``backend: "vllm"``, decoupled, no batch dimension, and every tensor of the backend release's interface
(:mod:`forge.profiles.vllm_releases`); ``1/model.json`` holding vLLM's engine arguments, each from a build flag
or a declared ``-o`` option (:data:`OPTIONS`); the checkpoint in ``1/hf``; with ``--lora``, the PEFT adapters in
``1/lora/NAME`` and ``1/multi_lora.json``. The vLLM backend hands ``model.json`` to vLLM's ``AsyncEngineArgs``
as it is, so a relative path would be read from the server's working directory: ``model`` and the adapter
paths are the absolute paths of the repository as built (``forge serve --docker`` mounts it at that path).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from forge import tritonconfig as tc
from forge.components import Artifact, Component, Option, TritonModel
from forge.errors import UsageError
from forge.in_triton.forge_glue import TOKENIZER_FILES

from ..profiles import vllm_releases

TARGET = "vllm"
CHECKPOINT_DIR = "hf"  # 1/hf: the checkpoint vLLM loads
LORA_DIR = "lora"
ARTIFACT_KIND = "hf-checkpoint"
_HF_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
#: vLLM's allowed LoRA ranks (``MaxLoRARanks`` of vllm/config/lora.py)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

#: the -o options a vllm build reads: option name → model.json key (the same name in vLLM's engine arguments)
OPTIONS = (
    Option("max_model_len", "int", "vllm target: the longest sequence, prompt and answer (default: the model's)",
           None, (TARGET,), minimum=1),
    Option("gpu_memory_utilization", "float", "vllm target: fraction of GPU memory for weights and KV cache "
           "(vLLM's default 0.9)", None, (TARGET,), exclusive_minimum=0),
    Option("kv_cache_memory_bytes", "int", "vllm target: KV cache size in bytes (instead of "
           "gpu_memory_utilization; what sizes it on a CPU)", None, (TARGET,), minimum=1),
    Option("enable_prefix_caching", "bool", "vllm target: reuse the KV cache of shared prompt prefixes", None,
           (TARGET,)),
    Option("enable_chunked_prefill", "bool", "vllm target: split long prompts into chunks scheduled with decoding",
           None, (TARGET,)),
    Option("max_num_seqs", "int", "vllm target: sequences scheduled together", None, (TARGET,), minimum=1),
    Option("max_num_batched_tokens", "int", "vllm target: tokens scheduled in one step", None, (TARGET,),
           minimum=1),
    Option("enforce_eager", "bool", "vllm target: no compiled graphs (faster start, slower steps)", None,
           (TARGET,)),
)
#: options other targets declare too, which a vllm build also reads (with --lora)
SHARED = ("lora", "max_loras", "max_lora_rank")
_LORA_LIMITS = ("max_loras", "max_lora_rank")
_LIMIT_OPTIONS = {"max_seq_len": "-o max_model_len", "max_batch_size": "-o max_num_seqs",
                  "max_num_tokens": "-o max_num_batched_tokens", "max_input_len": "-o max_model_len"}


def release(spec) -> vllm_releases.VllmInterface:
    """The vLLM backend release of the build: the Triton release ``--backend-version`` names (the CLI reads it as
    the TensorRT-LLM release of that Triton release), else the newest."""
    if spec.backend_version is None:
        return vllm_releases.interface()
    from ..profiles import resolve

    triton = resolve(spec.backend_version).triton
    return vllm_releases.interface(triton or spec.backend_version)


def check_spec(spec) -> None:
    """What a vllm build cannot take, refused before any stage runs."""
    release(spec)
    if spec.quant:
        raise UsageError(f"--quant {','.join(spec.quant)}: --target vllm serves the checkpoint's own weights; vLLM "
                         "reads the quantization a checkpoint carries (its config.json quantization_config)",
                         hint="build from a quantized checkpoint (AWQ, GPTQ, FP8, …), or drop --quant")
    if spec.limits.max_beam_width > 1:
        raise UsageError("--max-beam-width: Triton's vLLM backend samples; it has no beam search",
                         hint="use --max-beam-width 1")
    given = [name for name in _LIMIT_OPTIONS if name in spec.limits.given]
    if given:
        flag = given[0].replace("_", "-")
        raise UsageError(f"--{flag} has no effect on --target vllm: vLLM sizes itself from its engine arguments",
                         hint=f"use {_LIMIT_OPTIONS[given[0]]}")
    fraction = spec.options.get("gpu_memory_utilization")
    if fraction is not None and not 0 < float(fraction) <= 1:
        raise UsageError(f"-o gpu_memory_utilization must be in (0, 1], got {fraction}")
    limits = [name for name in _LORA_LIMITS if name in spec.options]
    if limits and not spec.options.get("lora"):
        raise UsageError(f"-o {', '.join(limits)}: LoRA limits without --lora adapters",
                         hint="ship adapters with --lora NAME=DIR, or drop the option")


def export(source: Path, ctx) -> Artifact:
    """No conversion: the checkpoint is checked and described; the repository holds a copy of its files."""
    from forge.hf import inspect_checkpoint

    spec = ctx.spec
    checkpoint = inspect_checkpoint(Path(source), allow_pickle=False, trust_remote_code=spec.trust_remote_code)
    if checkpoint.weight_format != "safetensors":
        raise UsageError(f"{source} has only pickle weights; --target vllm ships safetensors only",
                         hint="convert the checkpoint to safetensors first")
    config = dict(checkpoint.config)
    quant = (config.get("quantization_config") or {}).get("quant_method")
    meta = {"architecture": (config.get("architectures") or [""])[0], "source": str(Path(source).resolve()),
            "files": sorted(p.name for p in checkpoint.weight_files), "quantization": quant,
            "max_position_embeddings": config.get("max_position_embeddings") or config.get("n_positions")}
    ctx.note("export", {"format": "Hugging Face checkpoint (vLLM loads it as it is)",
                        "architecture": meta["architecture"], "quantization": quant})
    return Artifact(ARTIFACT_KIND, Path(source), meta)


def lora_rank(ranks: list[int], asked: Any = None) -> int:
    """The ``max_lora_rank`` for adapters of ``ranks``: as asked (refused below the largest adapter, or not a
    rank vLLM allows), else the smallest allowed rank that holds them."""
    need = max(ranks)
    if asked is not None:
        asked = int(asked)
        if asked not in LORA_RANKS:
            raise UsageError(f"-o max_lora_rank={asked} is not a rank vLLM allows; choose one of "
                             f"{', '.join(map(str, LORA_RANKS))}")
        if asked < need:
            raise UsageError(f"-o max_lora_rank={asked} is below the rank of the largest --lora adapter ({need})")
        return asked
    fits = [r for r in LORA_RANKS if r >= need]
    if not fits:
        raise UsageError(f"a --lora adapter has rank {need}; vLLM takes at most {LORA_RANKS[-1]}")
    return fits[0]


def engine_arguments(spec, meta: dict[str, Any], model_dir: Path, lora: dict[str, Any] | None) -> dict[str, Any]:
    """``1/model.json``: vLLM's engine arguments from the build spec (``model_dir`` is where the model will lie)."""
    doc: dict[str, Any] = {"model": str(model_dir / "1" / CHECKPOINT_DIR),
                           "tensor_parallel_size": spec.tp, "pipeline_parallel_size": spec.pp}
    if spec.dtype_given:
        doc["dtype"] = spec.dtype
    if meta.get("quantization"):
        doc["quantization"] = meta["quantization"]
    if spec.trust_remote_code:
        doc["trust_remote_code"] = True
    for option in OPTIONS:
        if option.name in spec.options:
            value = spec.options[option.name]
            doc[option.name] = _typed(value, option.kind)
    if lora:
        doc["enable_lora"] = True
        doc["max_loras"] = int(spec.options.get("max_loras", len(lora)))
        doc["max_lora_rank"] = lora_rank([a["rank"] for a in lora.values()], spec.options.get("max_lora_rank"))
    return doc


def _typed(value: Any, kind: str) -> Any:
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1")
    return int(value) if kind == "int" else float(value) if kind == "float" else value


def emit(component: Component, artifact: Artifact, ctx) -> list[TritonModel]:
    """The vLLM backend's model of ``component``."""
    spec = ctx.spec
    check_spec(spec)
    chosen = release(spec)
    name = component.ensemble
    model_dir = Path(spec.out).resolve() / name
    meta = artifact.meta
    lora = component.options.get("lora")
    doc = engine_arguments(spec, meta, model_dir, lora)
    inputs = [tc.model_input(n, dtype, list(dims), optional=optional) for n, dtype, dims, optional in chosen.inputs]
    outputs = [tc.model_output(n, dtype, list(dims)) for n, dtype, dims, _ in chosen.outputs]
    # parameters the vLLM backend does not read: what forge's clients and OpenAI front need to know
    longest = doc.get("max_model_len") or meta.get("max_position_embeddings")
    parameters = {"forge_target": TARGET, "tokenizer_dir": CHECKPOINT_DIR, "max_seq_len": longest,
                  "REPORT_CUSTOM_METRICS": "true"}  # vLLM's statistics as Triton metrics (the backend's switch)
    config = tc.model_config(name, backend="vllm", max_batch_size=0, inputs=inputs, outputs=outputs,
                             parameters=parameters, instances=1, instance_kind="KIND_MODEL", decoupled=True)
    source = Path(artifact.path)
    files: dict[str, Path | bytes] = {"1/model.json": (json.dumps(doc, indent=2) + "\n").encode()}
    for file in dict.fromkeys([*_HF_FILES, *TOKENIZER_FILES, *meta["files"]]):
        if (source / file).is_file():
            files[f"1/{CHECKPOINT_DIR}/{file}"] = source / file
    if lora:
        adapters = {}
        for adapter, entry in lora.items():
            for file in ("adapter_config.json", "adapter_model.safetensors"):
                files[f"1/{LORA_DIR}/{adapter}/{file}"] = Path(entry["source"]) / file
            adapters[adapter] = str(model_dir / "1" / LORA_DIR / adapter)
        files["1/multi_lora.json"] = (json.dumps(adapters, indent=2) + "\n").encode()
        # the manifest's adapter list, as clients read it (the OpenAI API's model ids); a request names one by name
        ctx.note("lora", {"model": name, "adapters": [
            {"name": adapter, "task_id": entry["task_id"], "path": f"1/{LORA_DIR}/{adapter}", "rank": entry["rank"]}
            for adapter, entry in lora.items()]})
    ctx.note("backend", {"version": chosen.version, "container": chosen.container, "layout": "vllm"})
    ctx.log(f"{name}: Triton's vLLM backend {chosen.version} ({', '.join(f'{k}={v}' for k, v in doc.items() if k != 'model')})")
    return [TritonModel(config, files)]
