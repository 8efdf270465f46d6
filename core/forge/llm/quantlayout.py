"""What TensorRT-LLM's loader asks of a quantized checkpoint, as data, and the checks forge makes.

The facts were read in TensorRT-LLM 0.16's source (``quantization/layers.py``,
``models/modeling_utils.py: preprocess_perlayer_weights``):

* weight-only linears (W8A16, W4A16) pad their input and output widths up to a multiple of 64·tp, and
  INT4-AWQ linears to max(64, group size)·tp; the loader then expects tensors of the padded size, which a
  checkpoint of the true size does not have, so forge refuses such widths instead of writing them;
* every quantized linear carries its scales (FP8: ``weights_scaling_factor`` and
  ``activation_scaling_factor``; INT4-AWQ: ``weights_scaling_factor`` and ``prequant_scaling_factor``);
  a quantized KV cache needs ``attention.kv_cache_scaling_factor`` in every layer;
* nvidia-modelopt's own ``config.json`` is its view of the model (GPT-2 as rotary ``rope_gpt_neox``,
  ``gelu`` for ``gelu_new``, ``GPT2LMHeadModel``), so forge keeps the config of its own export and takes
  only the quantization block and the embedding layout of modelopt's tensors from it.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterable, Mapping

from forge.errors import ForgeError, UsageError

from .tensorio import SafetensorsFile

#: The quantized linears of a decoder layer (TensorRT-LLM names, relative to ``transformer.layers.{i}.``).
LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
#: Scale tensors each calibrated weight algorithm writes next to every quantized linear's weight.
SCALES: Mapping[str, tuple[str, ...]] = {
    "FP8": ("weights_scaling_factor", "activation_scaling_factor"),
    "W4A16_AWQ": ("weights_scaling_factor", "prequant_scaling_factor"),
}
KV_SCALE = "attention.kv_cache_scaling_factor"
#: config.json keys that describe modelopt's tensors (embedding layout, padded vocabulary) or its quantization.
MODELOPT_KEYS = ("quantization", "vocab_size", "use_parallel_embedding", "embedding_sharding_dim",
                 "share_embedding_table")
PAD_UNIT = 64  # TensorRT-LLM's weight-only GEMMs pad widths to multiples of 64·tp
PADDED_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ")


def linear_widths(meta: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(input, output) width of every quantized linear as TensorRT-LLM builds it (KV heads duplicated to tp)."""
    tp, head = meta["tp"], meta["head_size"]
    q_dim = meta["num_heads"] * head
    kv_per_rank = -(-meta["num_kv_heads"] // tp)  # ranks share nothing: fewer KV heads than ranks are copied
    hidden, inter = meta["hidden_size"], meta["intermediate_size"]
    widths = {"attention.qkv": (hidden, q_dim + 2 * tp * kv_per_rank * head),
              "attention.dense": (q_dim, hidden),
              "mlp.fc": (hidden, inter), "mlp.proj": (inter, hidden)}
    if meta.get("family") == "llama":
        widths["mlp.gate"] = (hidden, inter)
    return widths


def pad_multiple(quant_algo: str | None, tp: int, group_size: int | None = None) -> int | None:
    """The multiple TensorRT-LLM pads this algorithm's linear widths to (None: no padding)."""
    if quant_algo not in PADDED_ALGOS:
        return None
    unit = max(PAD_UNIT, group_size or 0) if quant_algo == "W4A16_AWQ" else PAD_UNIT
    return unit * tp


def unpadded(meta: Mapping[str, Any], quant_algo: str | None, group_size: int | None = None) -> list[str]:
    """The widths TensorRT-LLM would pad (and then fail to load unpadded), as ``name in|out = width``."""
    multiple = pad_multiple(quant_algo, meta["tp"], group_size)
    if multiple is None:
        return []
    found = []
    for name, (width_in, width_out) in linear_widths(meta).items():
        found += [f"{name} {side} = {w}" for side, w in (("in", width_in), ("out", width_out)) if w % multiple]
    return found


def check_widths(meta: Mapping[str, Any], modes: Iterable[str], quant_algo: str | None,
                 group_size: int | None = None) -> None:
    """Refuse a weight format whose linears TensorRT-LLM would pad: the checkpoint would not load."""
    bad = unpadded(meta, quant_algo, group_size)
    if not bad:
        return
    multiple = pad_multiple(quant_algo, meta["tp"], group_size)
    what = f"max(64, group size {group_size})·tp" if quant_algo == "W4A16_AWQ" else "64·tp"
    smaller = [t for t in range(meta["tp"] - 1, 0, -1) if not unpadded({**meta, "tp": t}, quant_algo, group_size)]
    hint = (f"use --tp {smaller[0]}, " if smaller else "use ") + "--quant fp8 or int8_kv, or no weight quantization"
    raise UsageError(f"--quant {','.join(modes)} at --tp {meta['tp']}: TensorRT-LLM pads {quant_algo} layers to "
                     f"multiples of {what} = {multiple} and would not load this model's unpadded "
                     f"{', '.join(bad[:3])}{' …' if len(bad) > 3 else ''}", hint=hint)


def check_pipeline(meta: Mapping[str, Any], modes: Iterable[str]) -> None:
    """modelopt's exporter splits layers evenly over pipeline stages only."""
    layers, pp = meta.get("num_layers"), meta.get("pp", 1)
    if layers and layers % pp:
        raise UsageError(f"--quant {','.join(modes)} at --pp {pp}: nvidia-modelopt's checkpoint writer splits "
                         f"layers evenly over pipeline stages, and {layers} layers do not divide by {pp}",
                         hint="choose a pp that divides the layer count, or --quant w8a16 / w4a16 alone")


def merged_config(own: Mapping[str, Any], modelopt: Mapping[str, Any]) -> dict[str, Any]:
    """forge's export config with modelopt's quantization block and embedding layout."""
    config = dict(own)
    for key in MODELOPT_KEYS:
        if key in modelopt:
            config[key] = modelopt[key]
    return config


def _names(path: Path) -> set[str]:
    f = SafetensorsFile(path)
    try:
        return set(f.refs)
    finally:
        f.close()


def missing_tensors(float_ckpt: Path, quant_ckpt: Path, config: Mapping[str, Any]) -> list[str]:
    """Tensors the quantized checkpoint lacks: the float export's own tensors and the algorithms' scales."""
    quantization = config.get("quantization") or {}
    scales = SCALES.get(quantization.get("quant_algo") or "", ())
    excluded = quantization.get("exclude_modules") or ()
    missing = []
    for rank in range(config["mapping"]["world_size"]):
        want = _names(float_ckpt / f"rank{rank}.safetensors")
        for name in sorted(want):
            base, _, leaf = name.rpartition(".")
            if leaf == "weight" and base.rpartition(".")[0].endswith(("attention", "mlp")) and not any(fnmatchcase(base, pattern) for pattern in excluded):
                want |= {f"{base}.{scale}" for scale in scales}
            if quantization.get("kv_cache_quant_algo") and name.endswith(".attention.qkv.weight"):
                want.add(name.replace("attention.qkv.weight", KV_SCALE))
        have = _names(quant_ckpt / f"rank{rank}.safetensors")
        missing += [f"rank{rank}: {name}" for name in sorted(want - have)]
    return missing


def check_tensors(float_ckpt: Path, quant_ckpt: Path, config: Mapping[str, Any], producer: str) -> None:
    """Refuse a quantized checkpoint that lacks a tensor TensorRT-LLM's loader requires."""
    missing = missing_tensors(float_ckpt, quant_ckpt, config)
    if missing:
        raise ForgeError(f"{producer} wrote a checkpoint without {len(missing)} tensor(s) TensorRT-LLM's loader "
                         f"needs ({', '.join(missing[:3])}{' …' if len(missing) > 3 else ''})",
                         hint="report the nvidia-modelopt version in the manifest; another version may write them")
