"""The CUDA-graph decoder's layers per architecture: Llama-style and GPT-2 arithmetic over its KV cache.

``decoder_for`` picks the ``graphs.GraphDecoder`` subclass for a model (``unsupported`` says why there is none);
each subclass says where the model keeps its parts, prepares its tables (fused q/k/v and gate/up weights,
RoPE tables with the attention scale folded in) and writes the step and the prefill. ``Fused`` compiles a
Llama-style layer's pieces around attention (``-o torch_compile``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_gemm, cpu_kernels
from .graphs import GraphDecoder
from .kvlayout import PagedBlocks, StaticSlots


#: scaled_dot_product_attention takes fewer query heads than key/value heads itself (torch >= 2.5)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)

#: Model classes whose layers are Llama's: pre-norm, q/k/v/o projections (Qwen3 adds q/k norms), RoPE, gated MLP.
LLAMA_STYLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: GPT-2's layers: pre-LayerNorm, one q/k/v projection (Conv1D), learned positions, GELU MLP.
GPT2_STYLE = ("GPT2LMHeadModel",)


def unsupported(model, max_len: int) -> str | None:
    """Why ``model`` cannot decode through a ``GraphDecoder`` (None: it can)."""
    name = type(model).__name__
    if name in GPT2_STYLE:
        if getattr(model.config, "add_cross_attention", False):
            return "its layers have cross-attention"
        return None
    if name not in LLAMA_STYLE:
        return f"{name} is neither a Llama-style nor a GPT-2 model ({', '.join(LLAMA_STYLE + GPT2_STYLE)})"
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    if "dynamic" in kind or "longrope" in kind:
        return f"its rope type {kind!r} changes with the sequence length"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return "it has sliding-window layers"
    window = getattr(config, "sliding_window", None)
    if layer_types is None and window and getattr(config, "use_sliding_window", True) and window < max_len:
        return f"its sliding window ({window}) is shorter than max_seq_len ({max_len})"
    return None


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """A Llama RMSNorm (float32 statistics, weight applied in the input dtype) as few kernels."""
    return _rms(x, module.weight, _eps(module))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _eps(module) -> float:
    return getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)


def _add_linear(residual: torch.Tensor, x: torch.Tensor, linear) -> torch.Tensor:
    """``residual + linear(x)``, one GEMM with the addition folded in where the layer has no bias
    (any leading dimensions: the GEMM sees them flattened)."""
    if linear.bias is None:
        return _addmm(residual, x, linear.weight)
    return F.linear(x, linear.weight, linear.bias) + residual


def _addmm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``residual + x @ weight.T`` as one GEMM (any leading dimensions)."""
    flat = torch.addmm(residual.reshape(-1, residual.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t())
    return flat.view(residual.shape)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, start: int = 0) -> torch.Tensor:
    """Causal attention of q [n, heads, w, dim] over k, v [n, kv heads, start + w, dim] (kv heads divide
    heads): the queries are positions [start, start + w), the keys [0, start + w)."""
    heads, kv = q.shape[1], k.shape[1]
    mask = None
    if start:  # after a cached prefix: query i sees keys [0, start + i]
        width = q.shape[2]
        mask = torch.arange(start + width, device=q.device)[None, :] <= (start + torch.arange(width, device=q.device))[:, None]
    extra = {"is_causal": True} if mask is None else {"attn_mask": mask}
    if heads == kv:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **extra)
    if _SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **extra)
    k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **extra)


def _fuse(modules) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linear layers that read the same input; each module keeps a view of
    its rows, so the model's own forward (prefill) still works and no weight is held twice."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if any(m.bias is not None for m in modules):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(m.weight.shape[0])
                          for m in modules])
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(weight[start:start + rows], requires_grad=False)
        if m.bias is not None:
            m.bias = torch.nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return weight, bias


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim); GPT-2's config maps these names to n_head / n_embd."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads, kv, int(getattr(config, "head_dim", None) or config.hidden_size // heads)


def local_shape(model) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) this process holds: ``attention_shape`` of the config, or a
    tensor-parallel rank's share of it (distributed.shard cuts the projections; their sizes tell)."""
    heads, kv, dim = attention_shape(model.config)
    if type(model).__name__ in GPT2_STYLE:
        local = model.transformer.h[0].attn.c_attn.weight.shape[1] // (3 * dim)
        return local, local, dim
    attn = model.model.layers[0].self_attn
    return attn.q_proj.weight.shape[0] // dim, attn.k_proj.weight.shape[0] // dim, dim


def cache_bytes(model, rows: int, max_len: int) -> int:
    """Bytes of the static KV cache a decoder for ``model`` allocates (keys and values, every layer; one
    spare slot for the padding of captured prefills)."""
    _, kv, dim = local_shape(model)
    return StaticSlots.bytes_for(int(model.config.num_hidden_layers), rows, kv, dim, max_len,
                                 next(model.parameters()).element_size())


def block_bytes(model, block: int) -> int:
    """Bytes of one block of ``block`` tokens of a paged KV cache for ``model`` (keys and values, every layer)."""
    _, kv, dim = local_shape(model)
    return PagedBlocks.block_bytes(int(model.config.num_hidden_layers), kv, dim, block,
                                   next(model.parameters()).element_size())


def decoder_for(model, rows: int, max_len: int, *, capture: bool = True, paged: dict | None = None,
                reduce=None, available: int | None = None) -> "GraphDecoder":
    """The decoder for ``model``'s architecture; ``paged``: ``dict(block=, blocks=, reuse=)`` for a paged KV cache
    (kvlayout.PagedBlocks), else static slots (``unsupported`` says whether there is a decoder). ``reduce``: a
    tensor-parallel rank's all-reduce (in place), for a model distributed.shard has cut. Uncaptured on one rank,
    its GEMMs' weights are packed for oneDNN where that runs (``available``: host memory in bytes, cpu_gemm)."""
    cls = GPT2Decoder if type(model).__name__ in GPT2_STYLE else LlamaDecoder
    decoder = cls(model, rows, max_len, capture=capture, paged=paged)
    decoder.reduce = reduce
    if not decoder.capture and reduce is None:
        decoder.pack(available)
    return decoder


class LlamaDecoder(GraphDecoder):
    """Llama-style layers: RMSNorm, fused q/k/v and gate/up GEMMs, RoPE with the scale in its tables."""

    def _layout(self, model) -> None:
        inner, config = model.model, model.config
        self.rotary = inner.rotary_emb
        self.embed, self.layers, self.norm, self.head = inner.embed_tokens, list(inner.layers), inner.norm, model.lm_head
        self.heads, self.kv_heads, self.head_dim = local_shape(model)
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5))

    def _prepare(self, model) -> None:
        self.qkv = [_fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self.gate_up = [_fuse([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        cos, sin = self.rotary(self.keys[0], self.columns[None])
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated); the queries' rows
        # carry the attention scale, so scores need no extra multiplication
        sign = torch.ones(self.head_dim, dtype=torch.float32, device=self.device)
        sign[: self.head_dim // 2] = -1
        scale = torch.tensor([self.scale] * self.heads + [1.0] * self.kv_heads, dtype=torch.float32,
                             device=self.device)[None, :, None]
        self.cos = (cos[0].float()[:, None, :] * scale).to(self.dtype)  # [positions, heads + kv, dim]
        self.sin = (sin[0].float()[:, None, :] * sign * scale).to(self.dtype)

    def pack(self, available: int | None) -> None:
        layers = [(l.self_attn.o_proj, l.mlp.down_proj) for l in self.layers]
        head = self.head
        weights = [w for w, _ in self.qkv + self.gate_up] + [m.weight for pair in layers for m in pair] + [head.weight]
        reason = cpu_gemm.unpackable(weights, available)
        if reason is not None:
            self.packing = f"plain ({reason})"
            return
        self.packed = {"qkv": [cpu_gemm.Packed(*wb) for wb in self.qkv],
                       "gate_up": [cpu_gemm.Packed(*wb) for wb in self.gate_up],
                       "o": [cpu_gemm.Packed(o.weight, o.bias) for o, _ in layers],
                       "down": [cpu_gemm.Packed(d.weight, d.bias) for _, d in layers]}
        self.head = cpu_gemm.Packed(head.weight, head.bias)  # the step's and the prefill's logits (no LoRA on it)
        self.packing = "packed for oneDNN (cpu_gemm)"

    def _forward(self, rows: int, columns: int, modules: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, where = self._step_inputs(rows, columns)
        cos, sin = self.cos[pos], self.sin[pos]  # [b, heads + kv, dim]
        h = self.embed(ids)
        for i in range(len(self.layers)):
            qk, v = self._rotated_qkv(i, h, cos, sin, modules)
            out = self._attend(i, qk[:, :self.heads], qk[:, self.heads:], v, where, columns)
            h = self._rest_of_layer(i, h, out, modules)
        return self._picks(self.head(self._norm(self.norm, h)))

    def _final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self._norm(self.norm, h)

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        """``_norm``, as one call of cpu_kernels' C kernel where the step's attention runs through it (a CPU)."""
        if self.cpu_kernel is not None and cpu_kernels.norms(x, module.weight):
            return cpu_kernels.rms_norm(self.cpu_kernel, x, module.weight, _eps(module))
        return _norm(module, x)

    def _compiled(self, backend: str) -> Fused:
        return Fused(self, backend=backend)

    def _uncompilable(self) -> str | None:
        for layer in self.layers:
            mlp = layer.mlp
            if type(mlp.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
                return f"its MLP's activation is {type(mlp.act_fn).__name__}, not SiLU"
            if any(m.bias is not None for m in (layer.self_attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
                return "its output or MLP projections have biases"
        return None

    def _prefill(self, h: torch.Tensor, slots: torch.Tensor, modules: bool, start: int = 0,
                 slot: int | None = None) -> torch.Tensor:
        n, width = h.shape[:2]
        heads, dim = self.heads, self.head_dim
        cos, sin = self.cos[start:start + width], self.sin[start:start + width]  # [width, heads + kv, dim]
        for i in range(len(self.layers)):
            qk, v = self._rotated_qkv(i, h, cos, sin, modules)
            q, k, v = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)
            k, v = self._written(i, slots, start, slot, k, v)
            out = _causal(q, k, v, 1.0, start).transpose(1, 2).reshape(n, width, heads * dim)  # q carries the scale
            h = self._rest_of_layer(i, h, out, modules)
        return h

    # -- the pieces of a layer that the step and the prefill share (any leading dimensions) --------------
    def _rotated_qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     modules: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s queries and keys [..., heads + kv, dim] (RoPE applied, queries scaled) and values
        [..., kv, dim] of the hidden state ``h`` [..., hidden] (normed here)."""
        if self.fused is not None and not modules:
            return self.fused.qkv(h, *self.fused.layer_in[i], cos, sin)
        x = self._norm(self.layers[i].input_layernorm, h)
        attn, heads, kv, dim = self.layers[i].self_attn, self.heads, self.kv_heads, self.head_dim
        if modules:
            qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        elif self.packed is not None:
            qkv = self.packed["qkv"][i](x)
        else:
            qkv = F.linear(x, *self.qkv[i])
        qkv = qkv.unflatten(-1, (heads + 2 * kv, dim))
        qk, v = qkv[..., : heads + kv, :], qkv[..., heads + kv:, :]
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's queries and keys before RoPE
            qk = torch.cat([self._norm(attn.q_norm, qk[..., :heads, :]), self._norm(attn.k_norm, qk[..., heads:, :])],
                           dim=-2)
        swapped = qk.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)
        return torch.addcmul(qk * cos, swapped, sin), v

    def _rest_of_layer(self, i: int, h: torch.Tensor, out: torch.Tensor, modules: bool) -> torch.Tensor:
        """Layer ``i`` after attention: the output projection and the gated MLP, each with its residual."""
        layer = self.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        if self.fused is not None and not modules:
            if self.reduce is None:
                return self.fused.mlp(h, out, *self.fused.layer_out[i])
            # row-parallel: the ranks' sums sit between the compiled pieces (biases: rank 0's alone)
            _o_w, norm_w, gate_up_w, _down_w = self.fused.layer_out[i]
            h, act = self.fused.gated(h, self.reduce(F.linear(out, attn.o_proj.weight, attn.o_proj.bias)), norm_w,
                                      gate_up_w)
            return h + self.reduce(F.linear(act, mlp.down_proj.weight, mlp.down_proj.bias))
        if self.reduce is not None and not modules:  # row-parallel: sum the ranks' parts, then add the residual
            h = h + self.reduce(F.linear(out, attn.o_proj.weight, attn.o_proj.bias))  # biases: rank 0's alone
            gate, up = F.linear(self._norm(layer.post_attention_layernorm, h), *self.gate_up[i]).chunk(2, dim=-1)
            return h + self.reduce(F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias))
        if modules:
            h = h + attn.o_proj(out)
            x = self._norm(layer.post_attention_layernorm, h)
            return h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        if self.packed is not None:
            packed = self.packed
            h = h + packed["o"][i](out)
            gate, up = packed["gate_up"][i](self._norm(layer.post_attention_layernorm, h)).chunk(2, dim=-1)
            return h + packed["down"][i](mlp.act_fn(gate) * up)
        h = _add_linear(h, out, attn.o_proj)
        gate, up = F.linear(self._norm(layer.post_attention_layernorm, h), *self.gate_up[i]).chunk(2, dim=-1)
        return _add_linear(h, mlp.act_fn(gate) * up, mlp.down_proj)


class GPT2Decoder(GraphDecoder):
    """GPT-2 layers: LayerNorm, one Conv1D for q/k/v, learned position embeddings, GELU MLP. The
    projections are module calls in either mode (Conv1D already is one GEMM with its bias)."""

    def _layout(self, model) -> None:
        inner, config = model.transformer, model.config
        self.embed, self.positions, self.layers = inner.wte, inner.wpe, list(inner.h)
        self.norm, self.head = inner.ln_f, model.lm_head
        self.heads, self.kv_heads, self.head_dim = local_shape(model)

    def _prepare(self, model) -> None:
        config = model.config
        scales = []
        for i, layer in enumerate(self.layers):
            scale = getattr(layer.attn, "scaling", None)
            if scale is None:  # older transformers: the same rule
                scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
                scale /= float(i + 1) if config.scale_attn_by_inverse_layer_idx else 1.0
            scales.append(float(scale))
        self.scales = scales

    def _forward(self, rows: int, columns: int, modules: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        b, heads, dim = rows, self.heads, self.head_dim
        ids, pos, where = self._step_inputs(rows, columns)
        h = self.embed(ids) + self.positions(pos.clamp(max=self.positions.num_embeddings - 1))  # spare rows: any
        for i, layer in enumerate(self.layers):
            q, k, v = layer.attn.c_attn(layer.ln_1(h)).view(b, 3, heads, dim).unbind(1)
            out = self._attend(i, q * self.scales[i], k, v, where, columns)
            h = h + layer.attn.c_proj(out)
            h = h + layer.mlp(layer.ln_2(h))
        return self._picks(self.head(self.norm(h)))

    def _prefill(self, h: torch.Tensor, slots: torch.Tensor, modules: bool, start: int = 0,
                 slot: int | None = None) -> torch.Tensor:
        n, width = h.shape[:2]
        heads, dim = self.heads, self.head_dim
        h = h + self.positions(torch.arange(start, start + width, device=self.device))
        for i, layer in enumerate(self.layers):
            q, k, v = (t.transpose(1, 2) for t in
                       layer.attn.c_attn(layer.ln_1(h)).view(n, width, 3, heads, dim).unbind(2))
            k, v = self._written(i, slots, start, slot, k, v)
            out = _causal(q, k, v, self.scales[i], start).transpose(1, 2).reshape(n, width, heads * dim)
            h = h + layer.attn.c_proj(out)
            h = h + layer.mlp(layer.ln_2(h))
        return h


class Fused:
    """A Llama-style layer's pieces around attention as two functions compiled by ``torch.compile``.

    ``qkv``: input RMSNorm, the fused q/k/v GEMM, Qwen3's q/k norms and RoPE (queries scaled);
    ``mlp``: the output projection with its residual, RMSNorm, the fused gate/up GEMM, SiLU·mul and the down
    projection with its residual; on a tensor-parallel rank ``gated`` instead (the residual of the summed
    output projection, RMSNorm, gate/up GEMM and SiLU·mul), the all-reduces and the row-parallel GEMMs between
    the pieces. The same arithmetic as ``LlamaDecoder._rotated_qkv`` / ``_rest_of_layer``
    (float32 norm statistics, a residual folded into its GEMM); the compiler fuses the elementwise work
    around the GEMMs, so a step launches about half the kernels. Weights are arguments: one compiled
    function serves every layer; leading dimensions become dynamic after the warm-up's second size.
    """

    def __init__(self, decoder: "LlamaDecoder", *, backend: str = "inductor"):
        heads, kv, dim = decoder.heads, decoder.kv_heads, decoder.head_dim
        first = decoder.layers[0]
        eps = _eps(first.input_layernorm)
        qk_eps = _eps(first.self_attn.q_norm) if hasattr(first.self_attn, "q_norm") else eps

        def qkv(h, norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, sin):
            x = F.linear(_rms(h, norm_w, eps), qkv_w, qkv_b).unflatten(-1, (heads + 2 * kv, dim))
            qk, v = x[..., : heads + kv, :], x[..., heads + kv:, :]
            if q_norm_w is not None:
                qk = torch.cat([_rms(qk[..., :heads, :], q_norm_w, qk_eps), _rms(qk[..., heads:, :], k_norm_w, qk_eps)],
                               dim=-2)
            swapped = qk.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)
            return torch.addcmul(qk * cos, swapped, sin), v

        def mlp(h, out, o_w, norm_w, gate_up_w, down_w):
            h = _addmm(h, out, o_w)
            gate, up = F.linear(_rms(h, norm_w, eps), gate_up_w).chunk(2, dim=-1)
            return _addmm(h, F.silu(gate) * up, down_w)

        def gated(h, attended, norm_w, gate_up_w):  # a tensor-parallel rank's mlp between its two all-reduces
            h = h + attended
            gate, up = F.linear(_rms(h, norm_w, eps), gate_up_w).chunk(2, dim=-1)
            return h, F.silu(gate) * up

        if backend == "inductor":  # compile in this process: no pool of compile workers beside a served model
            from torch._inductor import config as inductor

            inductor.compile_threads = 1
        self.backend = backend
        self.qkv = torch.compile(qkv, backend=backend)
        self.mlp = torch.compile(mlp, backend=backend)
        self.gated = torch.compile(gated, backend=backend) if decoder.reduce is not None else None
        self.decoder = decoder
        self.layer_in, self.layer_out = [], []
        for i, layer in enumerate(decoder.layers):
            attn = layer.self_attn
            norms = (attn.q_norm.weight, attn.k_norm.weight) if hasattr(attn, "q_norm") else (None, None)
            self.layer_in.append((layer.input_layernorm.weight, *decoder.qkv[i], *norms))
            gate_up, _bias = decoder.gate_up[i]
            self.layer_out.append((attn.o_proj.weight, layer.post_attention_layernorm.weight, gate_up,
                                   layer.mlp.down_proj.weight))

    def warm_up(self) -> None:
        """Compile every form the step and the prefill use: 1 and several rows, 1 and several prompts."""
        d = self.decoder
        hidden = d.embed.weight.shape[1]
        with torch.inference_mode():  # as the engine steps: tensors made here are inference tensors there too
            for lead in ((1,), (2,), (3,), (1, 16), (1, 32), (2, 16), (3, 32)):
                h = torch.zeros((*lead, hidden), dtype=d.dtype, device=d.device)
                if len(lead) == 1:  # a step: each row's tables at its position
                    pos = torch.zeros(lead, dtype=torch.long, device=d.device)
                    cos, sin = d.cos[pos], d.sin[pos]
                else:  # a prefill: position = column
                    cos, sin = d.cos[: lead[1]], d.sin[: lead[1]]
                self.qkv(h, *self.layer_in[0], cos, sin)
                if self.gated is None:
                    self.mlp(h, torch.zeros((*lead, d.heads * d.head_dim), dtype=d.dtype, device=d.device),
                             *self.layer_out[0])
                else:  # no all-reduce inside: each rank compiles on its own
                    self.gated(h, torch.zeros_like(h), *self.layer_out[0][1:3])

