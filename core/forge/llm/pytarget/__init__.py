"""``--target python`` for decoders: a Triton python-backend model with the tensorrt_llm interface.

:func:`emit_model` builds the ``tensorrt_llm`` model of a repository as a python-backend model that
forge writes itself: ``1/model.py`` and ``1/forge_decoder/`` from ``forge.in_triton.python_target`` (the
runtime package: request checks, continuous-batching engine, sampling, responses) and ``1/hf/``
(the Hugging Face config and safetensors, linked from the source checkpoint). Its inputs and outputs
are exactly those of the C++ tensorrt_llm model of the chosen backend profile, so the preprocessing,
postprocessing, BLS and ensemble of the tensorrtllm target work unchanged in front of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ...components import Artifact, Component, TritonModel
from ...errors import UsageError
from ... import in_triton
from ... import tritonconfig as tc
from ... import profiles

RUNTIME_PACKAGE = "forge_decoder"  # the runtime's package name inside the model directory
WEIGHTS_DIR = "hf"
_HF_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")


def runtime_files() -> dict[str, bytes]:
    """The files of ``1/`` besides the weights: model.py and the runtime package.

    Contents, not paths: the driver hard-links paths, and editing a repository's model.py must not
    edit forge's own source.
    """
    files = {"1/model.py": in_triton.DECODER_MODEL.read_bytes(), **in_triton.glue_files()}
    for path in sorted([*in_triton.DECODER_RUNTIME.glob("*.py"), *in_triton.DECODER_RUNTIME.glob("*.c")]):
        files[f"1/{RUNTIME_PACKAGE}/{path.name}"] = path.read_bytes()
    return files


def weight_files(source: Path, *, allow_pickle: bool = False) -> dict[str, Path]:
    """``1/hf/…`` → the checkpoint files the python model loads (config and safetensors)."""
    from ...hf import inspect_checkpoint

    checkpoint = inspect_checkpoint(source, allow_pickle=allow_pickle)
    if checkpoint.weight_format != "safetensors":
        raise UsageError(f"{source} has only pickle weights; --target python loads safetensors only",
                         hint="convert the checkpoint to safetensors first")
    files = {f"1/{WEIGHTS_DIR}/{name}": source / name for name in _HF_FILES if (source / name).is_file()}
    for path in checkpoint.weight_files:
        files[f"1/{WEIGHTS_DIR}/{path.name}"] = path
    return files


def _message_inputs(inputs: Iterable[Any]) -> list:
    return [t if hasattr(t, "SerializeToString") else tc.model_input(
        t.name, t.dtype, t.dims, optional=t.optional, reshape=t.reshape, allow_ragged_batch=t.ragged)
        for t in inputs]


def _message_outputs(outputs: Iterable[Any]) -> list:
    return [t if hasattr(t, "SerializeToString") else tc.model_output(t.name, t.dtype, t.dims) for t in outputs]


def check_spec(spec) -> None:
    """Refuse build options the python target cannot honour (before any file is written)."""
    from ..interface import truthy

    if spec.quant:
        raise UsageError(f"--target python serves the checkpoint's own weights and cannot apply --quant "
                         f"{','.join(spec.quant)}", hint="drop --quant, or build --target tensorrtllm")
    if spec.pp > 1:
        raise UsageError(f"--target python runs tensor parallel only; --pp {spec.pp} applies to TensorRT-LLM engines",
                         hint=f"use --tp {spec.world_size} instead, or build --target tensorrtllm")
    if spec.tp > 1 and spec.options.get("lora"):
        raise UsageError(f"--target python at --tp {spec.tp} serves no LoRA adapters (their weights are not split "
                         "over the ranks)", hint="drop --lora, or build at --tp 1")
    if spec.tp > 1 and int(spec.options.get("instances", 1) or 1) > 1:
        raise UsageError(f"--target python at --tp {spec.tp} runs one model instance (its ranks form one group); "
                         f"--instances {spec.options['instances']} would need one group each",
                         hint="drop --instances")
    if spec.limits.max_beam_width > 1:
        raise UsageError("--target python does not do beam search", hint="use --max-beam-width 1")
    if spec.options.get("overlap_steps") == "true" and spec.options.get("paged_kv_cache") == "true":
        raise UsageError("-o overlap_steps=true overlaps the steps of the CUDA-graph decoder's static slots; "
                         "-o paged_kv_cache=true pages", hint="drop -o overlap_steps=true (auto overlaps where it can)")
    for option in ("torch_compile", "paged_kv_cache", "overlap_steps"):
        if spec.options.get("cuda_graphs") == "false" and spec.options.get(option) == "true":
            raise UsageError(f"-o {option}=true belongs to the CUDA-graph decoder, and -o cuda_graphs=false turns "
                             "that decoder off", hint="drop one of the two")
    if spec.options.get("paged_kv_cache") == "false" and truthy(spec.options.get("enable_kv_cache_reuse", False)):
        raise UsageError("-o enable_kv_cache_reuse=true shares blocks of a paged KV cache, and -o paged_kv_cache=false "
                         "keeps static slots", hint="drop one of the two")


def limits(spec, meta: dict[str, Any]) -> tuple[int, int]:
    """(max_input_len, max_seq_len): the tensorrtllm target's rule (within the position table, with room to
    generate), so preprocessing and this model agree."""
    from ..trtllm_build import sequence_limits

    return sequence_limits(spec, meta)


def runtime_choices(spec, ctx) -> dict[str, Any]:
    """What the served model will choose on this machine (the build machine) for device, dtype and threads.

    The model decides again when it starts (``auto`` follows the machine that serves it) and logs it.
    """
    import os

    device, dtype, threads = ctx.option("device", "auto"), ctx.option("compute_dtype", "auto"), ctx.option(
        "cpu_threads", 0)
    resolved: dict[str, Any] = {"device": device, "compute_dtype": dtype, "cpu_threads": threads}
    try:
        import torch

        from ...in_triton.python_target.forge_decoder import engine
    except ImportError:  # the build machine has no torch: nothing to resolve here
        return resolved
    where = engine.choose_device(device)
    compute = engine.choose_dtype(where, dtype, spec.dtype)
    resolved["on_this_machine"] = {
        "device": str(where), "compute_dtype": str(compute).removeprefix("torch."),
        "cpu_threads": engine.choose_threads(where, int(threads), compute), "cores": len(os.sched_getaffinity(0)),
        "inflight_sequences": engine.choose_rows(where, int(ctx.option("inflight_sequences", 0)),
                                                 spec.limits.max_batch_size),
        "cpu_bf16_matmul": engine.cpu_has_bf16(), "torch": torch.__version__}
    return resolved


def _lora_parameters(adapter, component: Component, spec, profile) -> dict[str, Any]:
    """The served model's LoRA settings: which modules take adapters, the adapter cache bounds (the backend's
    lora_cache_* parameters of the profile), and the shipped adapters to load at start (lora_prefetch_dir)."""
    from ..interface import parameter_value
    from ..lora_format import FOLDER, served_modules

    by_name = profile.llmapi  # the LLM-API interface names adapters per request (lora_id, lora_name, lora_path)
    if not adapter.lora_targets or (profile.interface("tensorrt_llm").input("lora_weights") is None and not by_name):
        return {}
    if spec.tp > 1:  # the ranks hold slices of the layers adapters would patch: served without LoRA modules
        return {}
    values: dict[str, Any] = {"lora_modules": served_modules(adapter)}
    for key in ("lora_cache_host_memory_bytes", "lora_cache_max_adapter_size"):
        p = profile.parameter("tensorrt_llm", key)
        if p is not None:
            values[key] = parameter_value(p, spec.options)
    if profile.parameter("tensorrt_llm", "lora_prefetch_dir") is not None or by_name:
        if "lora_prefetch_dir" in spec.options:
            values["lora_prefetch_dir"] = str(spec.options["lora_prefetch_dir"])
        elif component.options.get("lora"):
            values["lora_prefetch_dir"] = FOLDER  # relative: the model directory's lora/
    if by_name and component.options.get("lora"):  # which name each shipped task id answers to
        import json

        values["lora_names"] = json.dumps({name: e["task_id"] for name, e in component.options["lora"].items()},
                                          separators=(",", ":"))
    return values


def _text_parameters(component: Component, ctx) -> dict[str, Any]:
    """What the LLM-API interface's text front needs: the tokenizer (beside the weights) and end ids."""
    from ..interface import truthy
    from ..tokenizer_ids import tokenizer_defaults

    defaults = tokenizer_defaults(component.source, ctx.spec)
    return {"forge_layout": "llmapi", "tokenizer_dir": WEIGHTS_DIR,
            "end_id": ctx.option("end_id", defaults["end_id"]), "pad_id": ctx.option("pad_id", defaults["pad_id"]),
            "stop_token_ids": ctx.option("stop_token_ids", defaults["stop_token_ids"]),
            "add_special_tokens": truthy(ctx.option("add_special_tokens", True)),
            "skip_special_tokens": truthy(ctx.option("skip_special_tokens", True)),
            "trust_remote_code": ctx.spec.trust_remote_code}


def _text_files(source: Path, trust_remote_code: bool) -> dict[str, Path | bytes]:
    """The tokenizer files beside the weights (``1/hf``, as the LLM-API layout lays them out), the text modules
    the front imports, and the tokenizer's backend where it answers as transformers' tokenizer does
    (``forge_text.describe_backend``: the model process then loads without transformers' tokenizer classes)."""
    from ...in_triton import forge_text
    from ..llmapi import checkpoint_files  # its CHECKPOINT_DIR is this WEIGHTS_DIR: one layout of 1/hf

    files: dict[str, Path | bytes] = dict(checkpoint_files(source, []))
    files["1/forge_llmapi.py"] = in_triton.LLMAPI.read_bytes()
    files["1/forge_text.py"] = in_triton.TEXT.read_bytes()
    data = forge_text.backend_file(str(source), trust_remote_code)
    if data is not None:
        files[f"1/{WEIGHTS_DIR}/{forge_text.BACKEND_FILE}"] = data
    return files


def emit_model(adapter, component: Component, artifact: Artifact, ctx, profile) -> TritonModel:
    """The python-backend ``tensorrt_llm`` model of ``component`` for ``profile``'s interface."""
    from ..interface import tensorrt_llm_io, truthy

    spec = ctx.spec
    check_spec(spec)
    meta = dict(artifact.meta or {})
    inputs, outputs = tensorrt_llm_io(profile, spec, meta)
    max_input_len, max_seq_len = limits(spec, meta)
    decoupled = truthy(ctx.option("decoupled", bool(profile.llmapi)))  # the LLM-API layout streams by default
    exclude = ctx.option("exclude_input_in_output", None)
    parameters = {
        "forge_target": "python",
        "tensor_parallel": spec.tp,  # > 1: rank 0 of a group launched by forge serve / forge deploy
        "weights": WEIGHTS_DIR,
        "dtype": spec.dtype,
        "device": ctx.option("device", "auto"),
        "compute_dtype": ctx.option("compute_dtype", "auto"),
        "cpu_threads": ctx.option("cpu_threads", 0),
        "vocab_size": meta.get("vocab_size"),
        "max_input_len": max_input_len,
        "max_seq_len": max_seq_len,
        "max_num_sequences": spec.limits.max_batch_size,
        "inflight_sequences": ctx.option("inflight_sequences", 0),
        "sender_threads": ctx.option("sender_threads", 4),
        "stream_interval": ctx.option("stream_interval", 1),
        "cuda_graphs": ctx.option("cuda_graphs", "auto"),
        "torch_compile": ctx.option("torch_compile", "auto"),
        "paged_kv_cache": ctx.option("paged_kv_cache", "auto"),
        "overlap_steps": ctx.option("overlap_steps", "auto"),
        "engine_process": ctx.option("engine_process", "auto"),
        "enable_kv_cache_reuse": bool(truthy(ctx.option("enable_kv_cache_reuse", False))),
        "kv_cache_free_gpu_mem_fraction": ctx.option("kv_cache_free_gpu_mem_fraction"),
        "max_num_tokens": spec.limits.max_num_tokens or max(max_seq_len, 8192),
        "max_beam_width": 1,
        "cancellation_check_period_ms": ctx.option("cancellation_check_period_ms", 100),
        "exclude_input_in_output": None if exclude is None else truthy(exclude),
        # which outputs a response carries: the executor-based backend (v0.14.0 on) sends log probs, logits,
        # timings and token counts only when the request asks for them, older ones every output, zero-filled
        "response_outputs": "asked" if profiles.parse_version(profile.version) >= (0, 14, 0) else "all",
        **_lora_parameters(adapter, component, spec, profile),
    }
    files: dict[str, Path | bytes | str] = {**runtime_files(), **weight_files(component.source)}
    batch = spec.limits.max_batch_size
    batching: dict[str, Any] | bool = {"max_queue_delay_microseconds": int(ctx.option("max_queue_delay_microseconds", 0)),
                                       "max_queue_size": int(ctx.option("max_queue_size", 0))}
    if profile.llmapi:  # text in, text out: the LLM-API model's own shapes (no batch dimension)
        from ..llmapi import extension_io

        extra_inputs, extra_outputs = extension_io()  # forge's additions (token-id prompts, log-probs), optional
        inputs, outputs = inputs + extra_inputs, outputs + extra_outputs
        parameters.update(_text_parameters(component, ctx))
        files.update(_text_files(component.source, spec.trust_remote_code))
        batch, batching = 0, False
    config = tc.model_config(
        component.model_name("tensorrt_llm"), backend="python", max_batch_size=batch,
        inputs=_message_inputs(inputs), outputs=_message_outputs(outputs), parameters=parameters,
        instances=int(ctx.option("instances", 1)), instance_kind="KIND_CPU", dynamic_batching=batching,
        decoupled=decoupled)
    # Weights are hard-linked (they can be GBs); the code is written as contents.
    ctx.note("python_target", {"max_input_len": max_input_len, "max_seq_len": max_seq_len,
                               "decoupled": decoupled, "weights": sorted(k for k in files if "/hf/" in k),
                               "runtime": runtime_choices(spec, ctx)})
    return TritonModel(config, files)
