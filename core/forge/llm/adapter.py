"""Declarative description of a decoder family: accepted architectures, config names, weight names.

A family plugin is one :class:`DecoderAdapter` subclass of a few dozen lines (the way optimum's
per-model export configs are); the conversion, quantization and engine logic that reads these
declarations lives in :mod:`forge.llm.checkpoint`, :mod:`forge.llm.weight_quant` and :mod:`forge.llm.trtllm_build`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

# How a TensorRT-LLM tensor is cut across tensor-parallel ranks.
REPLICATE = "replicate"  # every rank holds the whole tensor (norms, row-parallel biases, embeddings)
COLUMN = "column"  # output features split: rank r holds rows [r·n/tp, (r+1)·n/tp)
ROW = "row"  # input features split: rank r holds columns [r·n/tp, (r+1)·n/tp)
QKV = "qkv"  # fused [Q; K; V]: each rank holds its heads of Q, K and V (KV heads duplicated if < tp)
VOCAB = "vocab"  # lm_head: rows padded with zeros to a multiple of tp, then split like COLUMN
KV = "kv"  # a separate K or V projection: each rank holds its KV heads (duplicated if < tp), as in QKV

#: Normalized dimension names usable in :attr:`Weight.shape` (see :meth:`DecoderAdapter.normalize`).
DERIVED_DIMS = ("q_dim", "kv_dim", "qkv_dim")


@dataclass(frozen=True)
class Weight:
    """One TensorRT-LLM tensor and the Hugging Face tensor(s) it is made from.

    ``source`` names use ``{i}`` for the layer index; a 3-tuple names separate Q, K, V tensors that
    are fused into one. ``shape`` is the full (unsplit) TensorRT-LLM shape in normalized dimension
    names; the expected Hugging Face shape follows from it (reversed when ``transpose``).
    """

    source: str | tuple[str, str, str]
    shape: tuple[str, ...]
    split: str = REPLICATE
    transpose: bool = False  # GPT-2's Conv1D stores [in, out]; TensorRT-LLM wants [out, in]
    tied: str | None = None  # used instead of ``source`` when the config ties the embeddings
    when: str | None = None  # a normalized boolean; the tensor exists only when it is true


@dataclass(frozen=True)
class LoraTarget:
    """How TensorRT-LLM applies a LoRA adapter to one Hugging Face module of every layer.

    ``module`` is TensorRT-LLM's LoRA module name (``attn_qkv``, ``mlp_h_to_4h`` …); ``dims`` the
    module's (out, in) features in normalized dimension names; ``split`` how its tensor-parallel
    layer is cut (the LoRA ``B`` rows follow a column split, the ``A`` columns a row split).
    """

    module: str
    dims: tuple[str, str]
    split: str


class DecoderAdapter:
    """Base class of the decoder family adapters; subclasses only fill in the class attributes."""

    family: ClassVar[str]
    description: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]  # Hugging Face ``architectures[0]`` values accepted
    trtllm_architecture: ClassVar[str]  # ``architecture`` written to the TensorRT-LLM config.json
    modelopt_decoder: ClassVar[str]  # nvidia-modelopt's ``decoder_type`` for this family
    #: ``-o parity=true``: max |Δlogit| / max(1, max |logit|) of a float32 export vs. transformers
    #: (scaled up for float16 / bfloat16 exports; ``--parity-tolerance`` overrides it)
    parity_tolerance: ClassVar[float] = 1e-4

    #: normalized name → Hugging Face config keys tried in order (dots reach into nested dicts)
    config_fields: ClassVar[Mapping[str, tuple[str, ...]]]
    #: normalized name → value (or function of the fields resolved so far) when no key is present
    config_defaults: ClassVar[Mapping[str, Any | Callable[[dict], Any]]] = {}
    #: TensorRT-LLM config.json key → normalized name, for the family-specific part of the config
    trtllm_fields: ClassVar[Mapping[str, str]] = {}
    #: TensorRT-LLM config.json constants of the family (position embedding type, variant, …)
    trtllm_constants: ClassVar[Mapping[str, Any]] = {}
    #: Hugging Face config key → (value TensorRT-LLM's model cannot reproduce, why) — refused on export
    unsupported: ClassVar[Mapping[str, tuple[Any, str]]] = {}

    #: prefixes tried in order in front of every source name (checkpoints saved with and without a base)
    weight_prefixes: ClassVar[tuple[str, ...]] = ("",)
    layer_weights: ClassVar[Mapping[str, Weight]]  # ``transformer.layers.{local}.`` + key
    first_stage_weights: ClassVar[Mapping[str, Weight]]  # on pipeline stage 0 only
    last_stage_weights: ClassVar[Mapping[str, Weight]]  # on the last pipeline stage only
    #: LoRA: module path inside the transformers model (``{i}`` = layer) → TensorRT-LLM's LoRA module
    lora_targets: ClassVar[Mapping[str, LoraTarget]] = {}

    def accepts(self, architecture: str) -> bool:
        """True when a checkpoint whose ``architectures[0]`` is ``architecture`` can be exported."""
        return architecture in self.architectures

    def normalize(self, hf_config: Mapping[str, Any]) -> dict[str, Any]:
        """Map a Hugging Face config to forge's normalized names (plus derived head dimensions)."""
        norm: dict[str, Any] = {}
        for name, keys in self.config_fields.items():
            value = next((v for v in (_lookup(hf_config, k) for k in keys) if v is not None), None)
            if value is None and name in self.config_defaults:
                default = self.config_defaults[name]
                value = default(norm) if callable(default) else default
            norm[name] = value
        self.normalize_extra(hf_config, norm)
        if all(isinstance(norm.get(k), int) for k in ("num_heads", "num_kv_heads", "head_size")):
            norm["q_dim"] = norm["num_heads"] * norm["head_size"]
            norm["kv_dim"] = norm["num_kv_heads"] * norm["head_size"]
            norm["qkv_dim"] = norm["q_dim"] + 2 * norm["kv_dim"]
        return norm

    def normalize_extra(self, hf_config: Mapping[str, Any], norm: dict[str, Any]) -> None:
        """Hook for the few values that are not a plain key lookup (e.g. RoPE scaling)."""

    def trtllm_config(self, norm: Mapping[str, Any]) -> dict[str, Any]:
        """The family-specific part of the TensorRT-LLM config.json."""
        return {**self.trtllm_constants, **{key: norm[name] for key, name in self.trtllm_fields.items()}}


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value
