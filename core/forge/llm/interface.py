"""The tensor interface and parameters of a decoder's Triton models, per backend-version profile.

Shared by both targets of the ``tensorrt_llm`` model (the C++ backend config and forge's python
model speak the same interface), by the text models and by the checks of ``-o`` values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from forge.errors import UsageError

from .. import profiles
from ..profiles import Parameter, Profile, Tensor

if TYPE_CHECKING:
    from forge.tritonconfig import mc

PRE, LLM, POST, BLS = "preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"
_DTYPES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}
_TYPE_OPTIONS = {  # -o options that choose a dtype the templates leave open
    profiles.LOGITS: "logits_datatype",
    profiles.PROMPT_TABLE: "prompt_embedding_table_data_type",
    profiles.ENCODER_FEATURES: "encoder_input_features_data_type",
}
#: -o options of forge's own models (every backend version) with their kind.
Log = Callable[[str], None]



def profile_of(spec) -> Profile:
    """The backend profile of a build (``--backend-version``, newest when absent)."""
    return profiles.resolve(spec.backend_version)


def truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("true", "1", "yes", "on")


def triton_dtype(name: str, value: Any) -> str:
    text = str(value).strip()
    key = _DTYPES.get(text.lower(), text.upper().removeprefix("TYPE_"))
    if key not in ("FP32", "FP16", "BF16"):
        raise UsageError(f"-o {name} takes TYPE_FP32, TYPE_FP16 or TYPE_BF16, got {value!r}")
    return key


def parameter_value(p: Parameter, options: Mapping[str, Any]) -> str | None:
    value = p.default if p.fixed else options.get(p.name, p.default)
    if value is None:
        return None
    if isinstance(value, bool) or p.kind == "bool":
        return "true" if truthy(value) else "false"
    return str(value)


def _engine_config(engine_dir: Path | None) -> Mapping[str, Any]:
    """The ``pretrained_config`` of a built engine (empty when there is none to read)."""
    if engine_dir is not None and (engine_dir / "config.json").is_file():
        try:
            return json.loads((engine_dir / "config.json").read_text()).get("pretrained_config", {})
        except ValueError:
            return {}
    return {}


def resolve_dtype(dtype: str, spec, meta: Mapping[str, Any] | None = None,
                  engine_dir: Path | None = None) -> str:
    """A profile dtype with the build's choice filled in for the types templates leave open."""
    if not dtype.startswith("$"):
        return dtype
    option = _TYPE_OPTIONS[dtype]
    if option in spec.options:
        return triton_dtype(option, spec.options[option])
    if dtype == profiles.LOGITS:
        logits = _engine_config(engine_dir).get("logits_dtype") or (meta or {}).get("logits_dtype")
        return _DTYPES.get(str(logits), "FP32")
    return _DTYPES.get(spec.dtype, "FP16")


def message_input(t: Tensor, dtype: str, *, ensemble_facing: bool = False) -> mc.ModelInput:
    from forge import tritonconfig as tc  # protobuf: loaded when a config is written, not to export

    dims = t.feed_dims if ensemble_facing and t.feed_dims else t.dims
    return tc.model_input(t.name, dtype, dims, optional=t.optional, reshape=t.reshape,
                          allow_ragged_batch=t.ragged)


def tensorrt_llm_io(profile: Profile, spec, meta: Mapping[str, Any] | None = None,
                    engine_dir: Path | None = None) -> tuple[list[mc.ModelInput], list[mc.ModelOutput]]:
    """The ``tensorrt_llm`` model's inputs and outputs for ``profile`` (every target uses these)."""
    from forge import tritonconfig as tc

    spec_io = profile.interface(LLM)
    inputs = [message_input(t, resolve_dtype(t.dtype, spec, meta, engine_dir)) for t in spec_io.inputs]
    outputs = [tc.model_output(t.name, resolve_dtype(t.dtype, spec, meta, engine_dir), t.dims)
               for t in spec_io.outputs]
    return inputs, outputs


def tensorrt_llm_parameters(profile: Profile, spec, *, engine_dir: str | None = None,
                            log: Log = lambda message: None) -> dict[str, str]:
    """The ``tensorrt_llm`` model's ``parameters`` for ``profile``: every -o option or its documented default."""
    options = spec.options
    values: dict[str, str] = {}
    for p in profile.params(LLM):
        if p.key == "gpt_model_path":
            value = options.get(p.name, engine_dir)
            value = None if value is None else str(value)
        elif p.key == "max_beam_width":
            value = str(options.get(p.name, spec.limits.max_beam_width))
        else:
            value = parameter_value(p, options)
        if value is None:
            continue
        if value in p.deprecated:
            log(f"warning: {p.name}={value} is deprecated in tensorrtllm_backend {profile.version}")
        values[p.key] = value
    return values
