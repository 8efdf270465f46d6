"""Every ``-o`` option a decoder build reads, declared as data (``forge options --family gpt`` prints it).

Two sources: forge's own options (its python models, the export, quantization and ``trtllm-build``),
and the template parameters of every tensorrtllm_backend profile (``fill_template.py`` keys). A
``tensorrt_llm`` engine parameter is read by the ``tensorrtllm`` target only; preprocessing,
postprocessing and BLS parameters go into forge's python models on every target. Which profile has
which parameter stays the family's check (:func:`check_options`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from forge.components import Option
from forge.contract import check_value
from forge.errors import UsageError

from .. import profiles
from .interface import BLS, profile_of, truthy
from ..profiles import YAML, Parameter, Profile

TRTLLM = ("tensorrtllm",)
PYTHON = ("python",)
ALL = ("tensorrtllm", "python")  # the targets with preprocessing / tensorrt_llm / postprocessing models
SERVED = ("python", "hf-pipeline")  # the targets whose model runs torch inside tritonserver

_KINDS = {"str": "str", "bool": "bool", "int": "int", "float": "float"}
DTYPES = "TYPE_FP32, TYPE_FP16 or TYPE_BF16"

#: forge's own options: its python models, export, quantization and the trtllm-build command line.
FORGE = (
    Option("decoupled", "bool", "streaming (decoupled) tensorrt_llm / BLS models; the LLM-API layout (the newest "
           "release) is decoupled unless -o decoupled=false", False, flag="--decoupled"),
    Option("bls", "bool", "add the tensorrt_llm_bls model (tensorrtllm_backend v0.7+)", False),
    Option("instances", "int", "instance count of every served model", 1, ALL + ("hf-pipeline",), minimum=1,
           flag="--instances"),
    Option("preprocessing_instance_count", "int", "instance count of preprocessing (default: --instances)",
           None, minimum=1),
    Option("postprocessing_instance_count", "int", "instance count of postprocessing (default: --instances)",
           None, minimum=1),
    Option("bls_instance_count", "int", "instance count of the BLS model (default: --instances)", None, minimum=1),
    Option("max_queue_delay_microseconds", "int", "dynamic batching delay of forge's models", 0, minimum=0),
    Option("max_queue_size", "int", "dynamic batching queue bound (0: unbounded)", 0, minimum=0),
    Option("add_special_tokens", "bool", "preprocessing adds the tokenizer's special tokens", True),
    Option("skip_special_tokens", "bool", "postprocessing drops special tokens from the text", True),
    Option("end_id", "int", "end-of-sequence token id (default: the tokenizer's)", None, minimum=0),
    Option("pad_id", "int", "padding token id (default: the tokenizer's, else end_id)", None, minimum=0),
    Option("stop_token_ids", "str", "extra end-of-turn token ids, comma-separated (default: generation_config)"),
    Option("logits_datatype", "str", f"dtype of context/generation logits outputs: {DTYPES}"),
    Option("prompt_embedding_table_data_type", "str", f"dtype of prompt_embedding_table: {DTYPES}"),
    Option("encoder_input_features_data_type", "str", f"dtype of encoder_input_features: {DTYPES}"),
    Option("parity", "bool", "check the exported checkpoint's logits against transformers", False),
    Option("parity_tolerance", "float", "max relative |Δlogit| of -o parity (default: the family's)", None,
           exclusive_minimum=0, flag="--parity-tolerance"),
    Option("calib_data", "path", "calibration text, one sample a line (int4_awq, fp8, int8_kv)", None,
           flag="--calib-data"),
    Option("calib_size", "int", "calibration samples", 64, minimum=1),
    Option("calib_seq_len", "int", "tokens per calibration sample", 256, minimum=1),
    Option("group_size", "int", "quantization group size (int4_awq, w4a16)", None, minimum=1, flag="--group-size"),
    # trtllm-build
    Option("context_fmha", "bool", "trtllm-build --context_fmha (fused attention; not for float32)", True, TRTLLM),
    Option("paged_context_fmha", "bool", "trtllm-build --use_paged_context_fmha", True, TRTLLM),
    Option("multiple_profiles", "bool", "trtllm-build --multiple_profiles", True, TRTLLM),
    Option("workers", "int", "trtllm-build --workers (default: the world size)", None, TRTLLM, minimum=1),
    Option("trtllm_build_args", "str", "extra trtllm-build arguments, appended verbatim", None, TRTLLM),
    # the python target's runtime
    Option("device", "str", "python / hf-pipeline targets: auto, cpu, cuda or cuda:N", "auto", SERVED),
    Option("compute_dtype", "choice", "python target: torch dtype of the served model (auto: --dtype on a GPU; on a "
           "CPU bfloat16 where it has bf16 matmuls, else float32)", "auto", PYTHON,
           choices=("auto", "float32", "bfloat16", "float16")),
    Option("cpu_threads", "int", "python / hf-pipeline targets: torch intra-op threads (0: automatic)", 0, SERVED,
           minimum=0),
    Option("inflight_sequences", "int", "python target: sequences decoded together (0: at least 32 on a CPU, "
           "at least 64 on a GPU)", 0, PYTHON, minimum=0),
    Option("sender_threads", "int", "python target: threads sending the responses (each send waits for the server's "
           "round trip; several keep more streams moving)", 4, PYTHON, minimum=1),
    Option("cuda_graphs", "choice", "python target: decoding steps through forge's static decoder (fused GEMMs over a "
           "static or paged KV cache), as CUDA graphs on a GPU (auto: for Llama-style and GPT-2 models, at any tp, "
           "captured on a GPU and run eagerly on a CPU; true: captured on a GPU or fail to load; false: the Hugging "
           "Face forward)", "auto", PYTHON, choices=("auto", "true", "false")),
    Option("torch_compile", "choice", "python target: the CUDA-graph decoder's Llama-style layers compiled by "
           "torch.compile into fused kernels at load (auto: where the step is captured on a GPU, at any tp, and "
           "compiling works, else eager with the reason logged; true: that or fail to load; false: eager)", "auto", PYTHON,
           choices=("auto", "true", "false")),
    Option("paged_kv_cache", "choice", "python target: the CUDA-graph decoder's KV cache in blocks handed out as "
           "sequences grow (auto: a static slot per row where that fits -o kv_cache_free_gpu_mem_fraction of the "
           "free GPU memory, on a CPU of the available host memory, default 0.5, else blocks; true: blocks; "
           "false: static slots)", "auto", PYTHON, choices=("auto", "true", "false")),
    Option("engine_process", "choice", "python target: the continuous-batching engine in a process of its own "
           "beside the python stub, so the stub's request and response threads never hold the interpreter lock "
           "the engine needs between its GPU launches; at tp > 1 that process leads the ranks (auto: where the model "
           "decodes on a GPU; true: anywhere; false: inside the stub)", "auto", PYTHON, choices=("auto", "true", "false")),
    Option("overlap_steps", "choice", "python target: each decoding step launched before the host has read the one "
           "before it, so between steps the GPU does not wait for the host (auto: where the steps are captured on "
           "a GPU with static slots (any tp), for steps whose rows are all plain greedy and not streamed; true: that "
           "wherever the decoder has static slots, or fail to load; false: one step at a time)", "auto", PYTHON,
           choices=("auto", "true", "false")),
)

# An option that names no target is read by the targets with the text models, not by hf-pipeline.
FORGE = tuple(o if o.targets else replace(o, targets=ALL) for o in FORGE)


def _adapter_dirs(value: Any) -> dict[str, str]:
    """``--lora NAME=DIR`` (repeated: a list) or ``-o lora=NAME=DIR,…`` → {name: absolute dir}: the same
    adapters from any working directory."""
    from .lora_format import parse_option

    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    return {name: str(path.resolve()) for name, path in parse_option(value).items()}


#: ``--lora``: declared by the decoder families that convert and ship adapters (forge.llm.plugin), not by
#: every family that reuses the decoder options.
LORA = Option("lora", "str", "PEFT LoRA adapters to ship, NAME=DIR (repeat --lora, or -o lora=NAME=DIR,…); "
              "task ids follow the order, from 1", None, ALL, flag="--lora", repeat=True, parse=_adapter_dirs)

#: Template parameters of the multimodal path, which forge's text models do not have:
#: not declared, so the driver refuses them instead of writing values nothing reads.
_MULTIMODAL = {"hf_model_path", "max_num_images", "multimodal_model_path", "visual_model_path",
               "multimodal_encoders_name"}

#: preprocessing / postprocessing parameters of the engine releases that the python target's text front reads
#: on the LLM-API interface (the tensorrtllm target refuses them there: the LLM API tokenizes)
TEXT_FRONT = {"add_special_tokens", "skip_special_tokens"}

#: tensorrt_llm parameters the python target honours too (same name, same meaning).
_PYTHON_READS = {"exclude_input_in_output", "cancellation_check_period_ms", "lora_cache_host_memory_bytes",
                 "lora_cache_max_adapter_size", "lora_prefetch_dir", "enable_kv_cache_reuse",
                 "kv_cache_free_gpu_mem_fraction", "stream_interval"}


def _from_parameters(versions: list[tuple[str, profiles.Parameter]]) -> Option:
    """One option for a parameter as every profile that has it declares it (newest default, all choices)."""
    newest = versions[-1][1]
    choices = tuple(dict.fromkeys(c for _, p in versions for c in p.choices))
    kind = "choice" if choices else _KINDS.get(newest.kind, "str")
    # tensorrt_llm parameters and model.yaml keys: the tensorrtllm target's (unless the python target reads them too)
    targets = TRTLLM if newest.model in ("tensorrt_llm", YAML) and newest.name not in _PYTHON_READS else ALL
    text = newest.help or f"{newest.model} parameter {newest.key}"
    names = [v for v, _ in versions]
    if len(names) < len(profiles.PROFILES):
        text += f" (backend {names[0]}–{names[-1]})" if len(names) > 1 else f" (backend {names[0]})"
    return Option(newest.name, kind, text, newest.default, targets, choices=choices)


@functools.cache
def decoder_options() -> tuple[Option, ...]:
    """forge's own options plus every profile's settable template parameters, one entry per name.

    Values valid in some release are accepted here; :func:`check_options` holds them to the chosen one.
    """
    options = {o.name: o for o in FORGE}
    seen: dict[str, list[tuple[str, profiles.Parameter]]] = {}
    for profile in profiles.PROFILES.values():
        for p in profile.parameters:
            if not p.fixed and p.name not in options and p.name not in _MULTIMODAL:
                seen.setdefault(p.name, []).append((profile.version, p))
    options.update({name: _from_parameters(versions) for name, versions in seen.items()})
    return tuple(options.values())


# -- per-version semantics (the driver has checked keys, targets and kinds) ------------------------

def check_options(spec) -> Profile:
    """Check ``-o`` values against the chosen backend version; return the profile. Cheap: call it at plan time.

    Keys, targets and kinds were checked by the driver against :func:`decoder_options`; what is
    left depends on the version: parameters of other releases, fixed ones, per-version choices.
    """
    profile = profile_of(spec)
    options = spec.options
    by_name = {p.name: p for p in profile.parameters if not p.fixed}
    fixed = {p.name for p in profile.parameters if p.fixed}
    elsewhere = _options_of_other_versions(profile)
    declared = {o.name: o for o in decoder_options()}
    for name, value in options.items():
        if name in declared:  # the driver checked them already; callers without a driver get the same
            check_value(declared[name], value)
        if name in by_name:
            _check_parameter(by_name[name], value, profile)
        elif name in fixed:
            raise UsageError(f"-o {name} is set by forge for backend {profile.version} and cannot be changed")
        elif name in elsewhere and not (profile.llmapi and name in TEXT_FRONT):
            raise UsageError(f"-o {name} is not a parameter of {_backend(profile)} {profile.version} "
                             f"(it exists in {elsewhere[name]})",
                             hint="drop it, or choose a --backend-version that has it")
    _check_beam_width(spec)
    if int(options.get("stream_interval", 1)) > 1 and not truthy(options.get("decoupled", profile.llmapi)):
        raise UsageError(f"-o stream_interval={options['stream_interval']} has nothing to space out: -o "
                         "decoupled=false builds a tensorrt_llm model that does not stream",
                         hint="drop -o decoupled=false, or -o stream_interval")
    if truthy(options.get("bls", False)) and not profile.has_model(BLS):
        first = next(p.version for p in profiles.PROFILES.values() if p.has_model(BLS))
        raise UsageError(f"-o bls=true needs tensorrtllm_backend {first} or newer; "
                         f"--backend-version {profile.version} has no tensorrt_llm_bls model")
    return profile


def _backend(profile: Profile) -> str:
    """How messages name the release: the LLM-API releases are TensorRT-LLM's own."""
    return "TensorRT-LLM" if profile.llmapi else "tensorrtllm_backend"


def has_trtllm_build(version: str) -> bool:
    return profiles.parse_version(version) >= profiles.BUILD_FLAGS["trtllm_build"]


def no_trtllm_build(version: str) -> str:
    return (f"tensorrtllm_backend {version} goes with TensorRT-LLM {version.lstrip('v')}, which predates trtllm-build "
            "and the unified checkpoint (0.8.0): its engines come from that release's examples/<model>/build.py, "
            "which forge does not drive")


def _options_of_other_versions(profile: Profile) -> dict[str, str]:
    seen: dict[str, list[str]] = {}
    for other in profiles.PROFILES.values():
        for p in other.parameters:
            if not p.fixed:
                seen.setdefault(p.name, []).append(other.version)
    mine = {p.name for p in profile.parameters}
    return {name: (versions[0] if len(versions) == 1 else f"{versions[0]}–{versions[-1]}")
            for name, versions in seen.items() if name not in mine}


def _check_parameter(p: Parameter, value: Any, profile: Profile) -> None:
    if p.choices and str(value) not in p.choices:
        raise UsageError(f"-o {p.name}={value} is not valid for {_backend(profile)} {profile.version}; "
                         f"choose one of {', '.join(p.choices)}")
    if p.name == "kv_cache_free_gpu_mem_fraction" and not 0 < float(value) <= 1:
        raise UsageError(f"-o kv_cache_free_gpu_mem_fraction must be in (0, 1], got {value}")
    if p.name == "stream_interval" and int(value) < 1:
        raise UsageError(f"-o stream_interval must be at least 1 (tokens per streamed response), got {value}")


def _check_beam_width(spec) -> None:
    value = spec.options.get("max_beam_width")
    if value is not None and not 1 <= int(value) <= spec.limits.max_beam_width:
        raise UsageError(f"-o max_beam_width={value} exceeds the engine's beam width "
                         f"(--max-beam-width {spec.limits.max_beam_width})",
                         hint="raise --max-beam-width so the engine is built for it")
