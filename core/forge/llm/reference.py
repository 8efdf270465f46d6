"""An independent numpy forward pass over TensorRT-LLM rank files, for parity checks.

It reads the rank files the way the TensorRT-LLM runtime uses them — column-parallel outputs
concatenated, row-parallel partial outputs summed with the bias added once, pipeline stages run in
order, vocabulary-padded logits trimmed — and shares no code with transformers' modeling files, so
agreement with transformers' logits checks the converter rather than restating it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .tensorio import SafetensorsFile, to_float32

_RMSNORM_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM"}
_TANH_GELU = {"gelu_new", "gelu_fast", "gelu_pytorch_tanh", "openai-gelu"}


def _float8_e4m3_table() -> np.ndarray:
    # FP8 E4M3 ("fn": no infinities, 0x7F/0xFF are NaN), decoded once into a 256-entry table.
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 7) / 8.0
    value = np.where(exp == 0, man * 2.0 ** -6, (1.0 + man) * 2.0 ** (exp - 7.0)) * sign
    value[(b & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


_FP8 = _float8_e4m3_table()


def load_rank(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one rank file as numpy (floating point, FP8 included, as float32; integers unchanged)."""
    f = SafetensorsFile(Path(path))
    try:
        out = {}
        for name, ref in f.refs.items():
            a = ref.array()
            if ref.tag in ("F32", "F16", "BF16"):
                out[name] = to_float32(a, ref.tag).copy()
            elif ref.tag == "F8_E4M3":
                out[name] = _FP8[a]
            else:
                out[name] = a.copy()
        return out
    finally:
        f.close()


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """modelopt's INT4 layout: byte [k, i] holds rows 2k (low nibble) and 2k+1 (high nibble), signed."""
    b = packed.view(np.uint8).astype(np.int16)
    low, high = b & 0x0F, b >> 4
    low, high = np.where(low >= 8, low - 16, low), np.where(high >= 8, high - 16, high)
    out = np.empty((packed.shape[0] * 2, packed.shape[1]), dtype=np.float32)
    out[0::2], out[1::2] = low, high
    return out


def dequantize_awq(weights: Mapping[str, np.ndarray], prefix: str, group_size: int) -> np.ndarray:
    """The float weight [out, in] that an INT4-AWQ linear layer computes with (pre-quant scale aside)."""
    q = unpack_int4(weights[f"{prefix}.weight"])
    scale = weights[f"{prefix}.weights_scaling_factor"].astype(np.float32)
    return q * np.repeat(scale, group_size, axis=1)[:, : q.shape[1]]


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz–Stegun 7.1.26 (|error| < 1.5e-7): numpy has no erf and the reference stays torch-free.
    s = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t
    y = 1.0 - poly * np.exp(-a * a)
    return s * y


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """The activation functions TensorRT-LLM names in ``hidden_act``."""
    if name in _TANH_GELU:
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "gelu":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if name in ("silu", "swish"):
        return x / (1.0 + np.exp(-x))
    if name == "relu":
        return np.maximum(x, 0.0)
    raise NotImplementedError(f"reference model has no activation {name!r}")


class ReferenceModel:
    """A TensorRT-LLM checkpoint directory, evaluated with numpy in float32."""

    def __init__(self, checkpoint_dir: Path):
        self.dir = Path(checkpoint_dir)
        self.config: dict[str, Any] = json.loads((self.dir / "config.json").read_text())
        mapping = self.config.get("mapping", {})
        self.tp, self.pp = mapping.get("tp_size", 1), mapping.get("pp_size", 1)
        self.ranks = [load_rank(self.dir / f"rank{r}.safetensors") for r in range(self.tp * self.pp)]
        quant = self.config.get("quantization") or {}
        self.quant_algo = quant.get("quant_algo")
        self.group_size = quant.get("group_size", 128)
        # Weight-only algorithms are applied by trtllm-build, so W8A16/W4A16 checkpoints hold float weights;
        # FP8 checkpoints are evaluated with dequantized weights and unquantized activations.
        if self.quant_algo not in (None, "W8A16", "W4A16", "W4A16_AWQ", "FP8"):
            raise NotImplementedError(f"reference model cannot evaluate {self.quant_algo} checkpoints")
        self.rmsnorm = bool(self.config.get("rmsnorm")) or self.config["architecture"] in _RMSNORM_ARCHITECTURES

    # -- building blocks ------------------------------------------------------------------------
    def _norm(self, w: Mapping[str, np.ndarray], prefix: str, x: np.ndarray) -> np.ndarray:
        eps = self.config.get("norm_epsilon", 1e-5)
        if self.rmsnorm:
            return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w[f"{prefix}.weight"]
        mean = x.mean(axis=-1, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
        y = (x - mean) / np.sqrt(var + eps) * w[f"{prefix}.weight"]
        return y + w[f"{prefix}.bias"] if f"{prefix}.bias" in w else y

    def _linear(self, w: Mapping[str, np.ndarray], prefix: str, x: np.ndarray, bias: bool = True) -> np.ndarray:
        if f"{prefix}.prequant_scaling_factor" in w:
            x = x * w[f"{prefix}.prequant_scaling_factor"]
        weight = w[f"{prefix}.weight"]
        if weight.dtype == np.int8 and f"{prefix}.weights_scaling_factor" in w:
            weight = dequantize_awq(w, prefix, self.group_size)
        elif self.quant_algo == "FP8" and f"{prefix}.weights_scaling_factor" in w:
            scale = w[f"{prefix}.weights_scaling_factor"].astype(np.float32)
            weight = weight * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(()))
        y = x @ weight.T
        if bias and f"{prefix}.bias" in w:
            y = y + w[f"{prefix}.bias"]
        return y

    def _rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        d = x.shape[-1]
        rot = int(d * self.config.get("rotary_pct", 1.0))
        base = float(self.config.get("rotary_base", 10000.0))
        scaling = self.config.get("rotary_scaling") or {}
        pos = positions.astype(np.float64)
        if scaling:
            if scaling.get("type") != "linear":
                raise NotImplementedError(f"reference model has no RoPE scaling {scaling.get('type')!r}")
            pos = pos / float(scaling["factor"])
        inv = base ** (-np.arange(0, rot, 2, dtype=np.float64) / rot)
        angles = pos[:, None] * inv[None, :]
        cos, sin = np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]
        x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)

    def _attention(self, w: Mapping[str, np.ndarray], prefix: str, h: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One rank's attention heads; returns its partial (pre-all-reduce) dense output."""
        c = self.config
        d = c.get("head_size") or c["hidden_size"] // c["num_attention_heads"]
        heads = c["num_attention_heads"] // self.tp
        kv = max(c.get("num_key_value_heads") or c["num_attention_heads"], self.tp) // self.tp
        qkv = self._linear(w, f"{prefix}.qkv", h)
        t = h.shape[0]
        q = qkv[:, : heads * d].reshape(t, heads, d)
        k = qkv[:, heads * d: (heads + kv) * d].reshape(t, kv, d)
        v = qkv[:, (heads + kv) * d:].reshape(t, kv, d)
        if c.get("position_embedding_type", "learned_absolute").startswith("rope"):
            q, k = self._rope(q, positions), self._rope(k, positions)
        group = heads // kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) / float(c.get("q_scaling", 1.0))
        scores = scores + np.triu(np.full((t, t), -np.inf, dtype=np.float32), 1)[None]
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(t, heads * d)
        return self._linear(w, f"{prefix}.dense", out, bias=False)

    def _mlp(self, w: Mapping[str, np.ndarray], prefix: str, h: np.ndarray) -> np.ndarray:
        """One rank's MLP slice; returns its partial (pre-all-reduce) projection output."""
        a = activation(self.config["hidden_act"], self._linear(w, f"{prefix}.fc", h))
        if f"{prefix}.gate.weight" in w:
            a = a * self._linear(w, f"{prefix}.gate", h)
        return self._linear(w, f"{prefix}.proj", a, bias=False)

    def _gather_rows(self, ranks: list[Mapping[str, np.ndarray]], name: str) -> np.ndarray:
        if self.config.get("use_parallel_embedding") and self.tp > 1:
            return np.concatenate([w[name] for w in ranks], axis=0)
        return ranks[0][name]

    # -- the forward pass -----------------------------------------------------------------------
    def logits(self, input_ids: Any, vocab_size: int | None = None) -> np.ndarray:
        """Logits [tokens, vocab] for one sequence of token ids (no KV cache: the whole prompt)."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        positions = np.arange(ids.shape[0])
        tp = self.tp
        first = self.ranks[:tp]
        x = self._gather_rows(first, "transformer.vocab_embedding.weight")[ids]
        if "transformer.position_embedding.weight" in first[0]:
            x = x + self._gather_rows(first, "transformer.position_embedding.weight")[positions]
        for stage in range(self.pp):
            ranks = self.ranks[stage * tp: (stage + 1) * tp]
            layers = sum(1 for n in ranks[0] if n.endswith(".input_layernorm.weight"))
            for i in range(layers):
                p = f"transformer.layers.{i}"
                h = self._norm(ranks[0], f"{p}.input_layernorm", x)
                attn = sum(self._attention(w, f"{p}.attention", h, positions) for w in ranks)
                if f"{p}.attention.dense.bias" in ranks[0]:
                    attn = attn + ranks[0][f"{p}.attention.dense.bias"]  # row-parallel bias: added once
                x = x + attn
                h = self._norm(ranks[0], f"{p}.post_layernorm", x)
                mlp = sum(self._mlp(w, f"{p}.mlp", h) for w in ranks)
                if f"{p}.mlp.proj.bias" in ranks[0]:
                    mlp = mlp + ranks[0][f"{p}.mlp.proj.bias"]
                x = x + mlp
        last = self.ranks[(self.pp - 1) * tp:]
        h = self._norm(last[0], "transformer.ln_f", x)
        logits = np.concatenate([h @ w["lm_head.weight"].T for w in last], axis=-1)
        return logits[:, : vocab_size or self.config["vocab_size"]]


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a − b| in float64."""
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
