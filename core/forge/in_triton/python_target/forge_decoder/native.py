"""A checkpoint's weights in the module tree the static decoder reads, without transformers' modeling code.

``graphs.GraphDecoder`` computes a step and a prefill from a model's weights and shape alone: it reads the
modules by their Hugging Face names (``model.layers[i].self_attn.q_proj`` …), the config's sizes and the
rotary tables. Importing transformers' model classes costs a model process about 2 s on a 2-core CPU (its
modeling code pulls in ``torch._dynamo`` and ``torch.distributed.tensor``), every start and every recovery of a
dead process. :func:`load` builds the same tree from ``config.json`` and the safetensors files. For Llama-style
models (Llama, Mistral, Qwen2, Qwen3): plain ``nn.Linear`` / ``nn.Embedding`` modules, an RMSNorm holding its
weight and epsilon, and the rotary embedding (the default, ``linear`` and ``llama3`` RoPE; anything else is left
to transformers); for GPT-2: LayerNorms, Conv1D projections and the MLP with transformers' own arithmetic (the
static decoder calls those modules). The tree has no forward: only a build whose decoding runs through the
static decoder loads it (``loading.load`` decides, and loads the transformers model where the static decoder
turns out not to run). :func:`why_not` says why a checkpoint keeps the transformers model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from .architectures import GPT2_STYLE, LLAMA_STYLE

ARCHITECTURES = LLAMA_STYLE + GPT2_STYLE  # those the static decoder computes
#: what Llama-style configs leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0}
ROPE_TYPES = ("default", "linear", "llama3")
#: checkpoint tensors that are not weights (older checkpoints saved the rotary frequencies)
SKIPPED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # GPT-2's causal-mask buffers


def read_config(model_dir: Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _rope(config: dict) -> dict:
    """The RoPE parameters (``rope_type``, ``rope_theta`` and the type's own), from transformers 5's
    ``rope_parameters`` or the older ``rope_theta`` + ``rope_scaling``."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", DEFAULTS["rope_theta"]))
    rope["rope_type"] = str(rope.get("rope_type", rope.get("type", "default")))
    return rope


def why_not(config: dict) -> str | None:
    """Why this checkpoint loads through transformers instead (None: :func:`load` builds it)."""
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in ARCHITECTURES:
        return f"{arch} is not one of {', '.join(ARCHITECTURES)}"
    if config.get("quantization_config"):
        return "the checkpoint is quantized"
    if arch in GPT2_STYLE:
        act = config.get("activation_function", "gelu_new")
        return None if act in GELU else f"its activation is {act}, not one of {', '.join(GELU)}"
    if config.get("hidden_act", DEFAULTS["hidden_act"]) != "silu":
        return f"its activation is {config.get('hidden_act')}, not silu"
    rope = _rope(config)
    if rope["rope_type"] not in ROPE_TYPES:
        return f"its rope type {rope['rope_type']!r} is not one of {', '.join(ROPE_TYPES)}"
    if float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))) != 1.0:
        return "its rotary embedding covers part of each head"
    return None


class RMSNorm(nn.Module):
    """A weight and its epsilon (the static decoder computes the norm: ``architectures._norm``)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.variance_epsilon = eps


class Rotary(nn.Module):
    """``(cos, sin)`` of positions ``[1, n]`` as ``[1, n, head_dim]`` in ``x``'s dtype, as transformers' rotary
    embedding computes them (float32 frequencies, both halves alike)."""

    def __init__(self, inv_freq: torch.Tensor):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def inv_freq(rope: dict, head_dim: int, max_positions: int) -> torch.Tensor:
    """The rotary frequencies of RoPE type ``default``, ``linear`` or ``llama3`` (Meta's Llama 3.1 scaling)."""
    base = float(rope["rope_theta"])
    freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope["rope_type"]
    if kind == "linear":
        return freq / float(rope["factor"])
    if kind != "llama3":
        return freq
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope.get("original_max_position_embeddings", max_positions))
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old / low, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def _linear(state: dict, name: str) -> nn.Linear:
    weight = state.pop(f"{name}.weight")
    bias = state.pop(f"{name}.bias", None)
    module = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    module.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        module.bias = nn.Parameter(bias, requires_grad=False)
    return module


def _norm(state: dict, name: str, eps: float) -> RMSNorm:
    norm = RMSNorm(1, eps)
    norm.weight = nn.Parameter(state.pop(f"{name}.weight"), requires_grad=False)
    return norm


class _Layer(nn.Module):
    def __init__(self, state: dict, prefix: str, eps: float, head_dim: int):
        super().__init__()
        attn = nn.Module()
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, part, _linear(state, f"{prefix}.self_attn.{part}"))
        if f"{prefix}.self_attn.q_norm.weight" in state:  # Qwen3: RMSNorm over each head's queries and keys
            attn.q_norm = _norm(state, f"{prefix}.self_attn.q_norm", eps)
            attn.k_norm = _norm(state, f"{prefix}.self_attn.k_norm", eps)
        attn.scaling = head_dim ** -0.5
        mlp = nn.Module()
        for part in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, part, _linear(state, f"{prefix}.mlp.{part}"))
        mlp.act_fn = nn.SiLU()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = _norm(state, f"{prefix}.input_layernorm", eps)
        self.post_attention_layernorm = _norm(state, f"{prefix}.post_attention_layernorm", eps)


def _head(state: dict, embed: nn.Embedding, tied: bool) -> nn.Linear:
    """The output projection: the embeddings' weight where the config ties them (as transformers ties it,
    whatever the checkpoint holds), else the checkpoint's ``lm_head.weight``."""
    head = state.pop("lm_head.weight", None)
    if tied:
        head = embed.weight
    elif head is None:
        raise ValueError("the checkpoint has no lm_head.weight and does not tie it to the embeddings")
    linear = nn.Linear(head.shape[1], head.shape[0], bias=False, device="meta")
    linear.weight = head if isinstance(head, nn.Parameter) else nn.Parameter(head, requires_grad=False)
    return linear


def _no_more(state: dict) -> None:
    left = [k for k in state if not k.endswith(SKIPPED)]
    if left:
        raise ValueError(f"the checkpoint has tensors the model does not: {', '.join(sorted(left)[:4])}")


class _Weights(nn.Module):
    """A causal LM's weights under transformers' names, ``config`` its config.json as attributes, ``lm_head`` its
    output projection and ``embeddings`` the name of its token embeddings. Its class is named after the
    checkpoint's architecture (what ``architectures`` dispatches on). No forward of its own."""

    embeddings = ""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.get_submodule(self.embeddings)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise RuntimeError("this model holds weights for forge's static decoder and has no forward of its own")


class NativeCausalLM(_Weights):
    """A Llama-style causal LM's weights (``model.layers[i].self_attn.q_proj`` …)."""

    embeddings = "model.embed_tokens"

    def __init__(self, config: dict, state: dict[str, torch.Tensor]):
        super().__init__()
        values = {**DEFAULTS, **config}
        heads = int(values["num_attention_heads"])
        values.setdefault("num_key_value_heads", heads)
        values["head_dim"] = int(values.get("head_dim") or values["hidden_size"] // heads)
        self.config = SimpleNamespace(**values)
        eps, layers = float(values["rms_norm_eps"]), int(values["num_hidden_layers"])
        inner = nn.Module()
        inner.embed_tokens = nn.Embedding.from_pretrained(state.pop("model.embed_tokens.weight"), freeze=True)
        inner.layers = nn.ModuleList(_Layer(state, f"model.layers.{i}", eps, values["head_dim"]) for i in range(layers))
        inner.norm = _norm(state, "model.norm", eps)
        positions = int(values.get("max_position_embeddings") or 2048)
        inner.rotary_emb = Rotary(inv_freq(_rope(values), values["head_dim"], positions))
        self.model = inner
        self.lm_head = _head(state, inner.embed_tokens, values["tie_word_embeddings"])
        _no_more(state)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:  # transformers' NewGELUActivation, the same operations
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


#: GPT-2's activations by config name (``activation_function``)
GELU = {"gelu_new": _gelu_new, "gelu": nn.functional.gelu,
        "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh")}
GPT2_DEFAULTS = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "layer_norm_epsilon": 1e-5,
                 "activation_function": "gelu_new", "scale_attn_weights": True, "tie_word_embeddings": True,
                 "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}


class Conv1D(nn.Module):
    """GPT-2's projection: ``x @ weight + bias`` with the weight stored [in, out], as transformers computes it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.weight.shape[1])


class _GPT2MLP(nn.Module):
    def __init__(self, c_fc: Conv1D, c_proj: Conv1D, act):
        super().__init__()
        self.c_fc, self.c_proj, self.act = c_fc, c_proj, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


def _layer_norm(state: dict, name: str, eps: float) -> nn.LayerNorm:
    weight = state.pop(f"{name}.weight")
    norm = nn.LayerNorm(weight.shape[0], eps=eps, device="meta")
    norm.weight = nn.Parameter(weight, requires_grad=False)
    norm.bias = nn.Parameter(state.pop(f"{name}.bias"), requires_grad=False)
    return norm


def _conv(state: dict, name: str) -> Conv1D:
    return Conv1D(state.pop(f"{name}.weight"), state.pop(f"{name}.bias"))


class NativeGPT2(_Weights):
    """GPT-2's weights (``transformer.h[i].attn.c_attn`` …)."""

    embeddings = "transformer.wte"

    def __init__(self, config: dict, state: dict[str, torch.Tensor]):
        super().__init__()
        values = {**GPT2_DEFAULTS, **config}
        values.update(hidden_size=values["n_embd"], num_attention_heads=values["n_head"],
                      num_hidden_layers=values["n_layer"], max_position_embeddings=values["n_positions"])
        self.config = SimpleNamespace(**values)
        if not any(k.startswith("transformer.") for k in state):  # the original checkpoints name no prefix
            state.update({f"transformer.{k}": state.pop(k) for k in list(state) if not k.startswith("lm_head.")})
        eps, act = float(values["layer_norm_epsilon"]), GELU[values["activation_function"]]
        inner = nn.Module()
        inner.wte = nn.Embedding.from_pretrained(state.pop("transformer.wte.weight"), freeze=True)
        inner.wpe = nn.Embedding.from_pretrained(state.pop("transformer.wpe.weight"), freeze=True)
        blocks = []
        for i in range(int(values["n_layer"])):
            prefix = f"transformer.h.{i}"
            block = nn.Module()
            block.ln_1 = _layer_norm(state, f"{prefix}.ln_1", eps)
            block.ln_2 = _layer_norm(state, f"{prefix}.ln_2", eps)
            block.attn = nn.Module()
            block.attn.c_attn = _conv(state, f"{prefix}.attn.c_attn")
            block.attn.c_proj = _conv(state, f"{prefix}.attn.c_proj")
            block.mlp = _GPT2MLP(_conv(state, f"{prefix}.mlp.c_fc"), _conv(state, f"{prefix}.mlp.c_proj"), act)
            blocks.append(block)
        inner.h = nn.ModuleList(blocks)
        inner.ln_f = _layer_norm(state, "transformer.ln_f", eps)
        self.transformer = inner
        self.lm_head = _head(state, inner.wte, values["tie_word_embeddings"])
        _no_more(state)


def _files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [model_dir / "model.safetensors"]


def load(model_dir: Path, device: torch.device, dtype: torch.dtype, config: dict | None = None) -> nn.Module:
    """The checkpoint in ``model_dir`` (safetensors; :func:`why_not` None; ``config``: its config.json, read here
    when not given) as a :class:`NativeCausalLM` or :class:`NativeGPT2` on ``device`` in ``dtype``; ValueError
    where its tensors or config keys are not the architecture's."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = config or read_config(model_dir)
    state: dict[str, torch.Tensor] = {}
    for path in _files(model_dir):
        for name, tensor in load_file(str(path), device=str(device)).items():
            state[name] = tensor if tensor.dtype == dtype or not tensor.is_floating_point() else tensor.to(dtype)
    arch = config["architectures"][0]
    try:
        model = type(arch, (NativeGPT2 if arch in GPT2_STYLE else NativeCausalLM,), {})(config, state)
    except KeyError as exc:  # tensor names have dots, config keys none
        key = str(exc.args[0])
        raise ValueError(f"the checkpoint has no {'tensor' if '.' in key else 'config key'} {key}") from None
    return model.eval()


def loaded_here(model) -> bool:
    """Whether ``model`` is one :func:`load` made (weights only: no forward)."""
    return isinstance(model, _Weights)
