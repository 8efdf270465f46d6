"""Decoding steps replayed as CUDA graphs over a static KV cache (Llama-style models).

The engine's plain decoding step is the Hugging Face forward: on a GPU it is bound by Python and
kernel launches (H100, SmolLM2-135M shape: ~1200 launches and 21–27 ms a step at 1 to 64 rows, the
GPU busy 12 % of it). Here the step is the same arithmetic written over buffers that never move —
per layer one key and one value cache of ``[rows, kv heads, columns, head dim]``, every running
sequence in a slot, its new token written at its own position — so it is captured once per (row
bucket, column bucket) and replayed with one launch.

* Prefill stays on the Hugging Face forward; ``admit`` copies each new row's keys and values into
  its slot (without the batch's left padding, so a row's column is its position).
* Slots follow the engine's row order: ``keep`` packs the rows that stay to the front.
* Rows past the running ones in a bucket, and the warm-up before a capture, write into one spare
  column at the end of every slot, which no row ever attends to.

A step with a LoRA adapter in the batch runs eagerly through the projection modules, whose hooks add
the adapters; steps without one replay the graphs. Tensor-parallel followers repeat the Hugging Face
forward, so those builds decode the plain way; prompt tables only touch prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kvcache

#: Model classes whose layers are Llama's: pre-norm, q/k/v/o projections (Qwen3 adds q/k norms), RoPE, gated MLP.
LLAMA_STYLE = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
FIRST_COLUMNS = 128


def unsupported(model, max_len: int) -> str | None:
    """Why ``model`` cannot decode through ``GraphDecoder`` (None: it can)."""
    name = type(model).__name__
    if name not in LLAMA_STYLE:
        return f"{name} is not a Llama-style model ({', '.join(LLAMA_STYLE)})"
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
    eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
    return module.weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _add_linear(residual: torch.Tensor, x: torch.Tensor, linear) -> torch.Tensor:
    """``residual + linear(x)``, one GEMM with the addition folded in where the layer has no bias."""
    if linear.bias is None:
        return torch.addmm(residual, x, linear.weight.t())
    return F.linear(x, linear.weight, linear.bias) + residual


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


class GraphDecoder:
    """The decoding step of up to ``rows`` sequences of up to ``max_len`` tokens, as CUDA graphs.

    With ``capture=False`` (or on a CPU) the same step runs eagerly: what the tests check against
    transformers on a machine without a GPU.
    """

    def __init__(self, model, rows: int, max_len: int, *, capture: bool = True):
        inner = model.model
        config = model.config
        self.embed, self.layers, self.norm, self.head = inner.embed_tokens, list(inner.layers), inner.norm, model.lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5))
        weight = self.embed.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.rows, self.max_len = rows, max_len
        self.spare = max_len  # the column no row attends to
        shape = (rows, self.kv_heads, max_len + 1, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        with torch.no_grad():
            self.qkv = [_fuse([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
            self.gate_up = [_fuse([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        with torch.inference_mode():
            positions = torch.arange(max_len + 1, device=self.device)
            cos, sin = inner.rotary_emb(self.keys[0], positions[None])
            half = self.head_dim // 2
            # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated); the queries'
            # rows carry the attention scale, so scores need no extra multiplication
            sign = torch.ones(self.head_dim, dtype=sin.dtype, device=self.device)
            sign[:half] = -1
            scale = torch.tensor([self.scale] * self.heads + [1.0] * self.kv_heads, dtype=torch.float32,
                                 device=self.device)[None, :, None]
            self.cos = (cos[0].float()[:, None, :] * scale).to(self.dtype)  # [positions, heads + kv, dim]
            self.sin = (sin[0].float()[:, None, :] * sign.float() * scale).to(self.dtype)
        self.columns = positions
        self.heads_offset = (torch.arange(rows, device=self.device)[:, None] * self.kv_heads
                             + torch.arange(self.kv_heads, device=self.device)[None, :]) * (max_len + 1)
        self.inputs = torch.zeros((2, rows), dtype=torch.long, device=self.device)  # ids, positions
        self.staging = torch.zeros((2, rows), dtype=torch.long, pin_memory=self.device.type == "cuda")
        self.capture = capture and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.picks: torch.Tensor | None = None  # [rows, 2]: each row's argmax token and its log-probability
        self.pool = None
        self.used = 0  # slots holding running sequences

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    # -- the slots ----------------------------------------------------------------------------------
    def admit(self, cache, lengths: list[int], width: int) -> None:
        """Copy a prefill's keys and values (left-padded to ``width``) into the next free slots."""
        first = self.used
        if first + len(lengths) > self.rows:
            raise RuntimeError(f"{first + len(lengths)} rows do not fit the {self.rows} slots")
        if max(lengths) >= self.max_len:
            raise RuntimeError(f"a prompt of {max(lengths)} tokens does not fit {self.max_len} columns")
        same = all(n == width for n in lengths)
        for (k, v), keys, values in zip(kvcache.layers(cache), self.keys, self.values):
            if same:
                keys[first:first + len(lengths), :, :width] = k
                values[first:first + len(lengths), :, :width] = v
                continue
            for i, n in enumerate(lengths):
                keys[first + i, :, :n] = k[i, :, width - n:]
                values[first + i, :, :n] = v[i, :, width - n:]
        self.used += len(lengths)

    def keep(self, rows: list[int]) -> None:
        """Keep only the slots ``rows`` (in that order), packed to the front."""
        if rows != list(range(len(rows))):
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
            for t in self.keys + self.values:
                t[: len(rows)] = t.index_select(0, index)
        self.used = len(rows)

    def reset(self) -> None:
        self.used = 0

    # -- the step -----------------------------------------------------------------------------------
    def step(self, tokens: list[int], positions: list[int], *, modules: bool = False) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` for each slot's next token at its position (``greedy`` has the
        argmax of each row and its log-probability). ``modules``: run eagerly through the model's own
        projection modules, so forward hooks (LoRA adapters) apply to this step."""
        n = len(tokens)
        rows = next((b for b in ROW_BUCKETS if n <= b <= self.rows), self.rows)
        need = max(positions) + 1
        if need > self.max_len:
            raise RuntimeError(f"position {need - 1} is past the {self.max_len} columns of the cache")
        columns = FIRST_COLUMNS
        while columns < need:
            columns *= 2
        columns = min(columns, self.max_len)
        if self.capture and not modules and (rows, columns) not in self.graphs:
            self._capture(rows, columns)
        self.staging[0, :n] = torch.as_tensor(tokens)
        self.staging[1, :n] = torch.as_tensor(positions)
        self.staging[0, n:rows] = 0
        self.staging[1, n:rows] = self.spare
        self.inputs[:, :rows].copy_(self.staging[:, :rows], non_blocking=True)
        if modules or not self.capture:
            logits, self.picks = self._forward(rows, columns, modules=modules)
            return logits[:n]
        graph, logits, self.picks = self.graphs[(rows, columns)]
        graph.replay()
        return logits[:n]

    def greedy(self, n: int) -> tuple[list[int], list[float]]:
        """The last step's argmax token of each of the first ``n`` rows and its log-probability."""
        picks = self.picks[:n].tolist()
        return [int(t) for t, _ in picks], [lp for _, lp in picks]

    def _capture(self, rows: int, columns: int) -> None:
        # Warm up outside the capture (cuBLAS and the allocator set themselves up lazily); every row
        # writes into the spare column meanwhile, so running sequences keep their caches.
        self.inputs[0, :rows] = 0
        self.inputs[1, :rows] = self.spare
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(rows, columns)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits, picks = self._forward(rows, columns)
        self.pool = graph.pool()
        self.graphs[(rows, columns)] = (graph, logits, picks)

    def _forward(self, rows: int, columns: int, modules: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One token for slots [0, rows) attending to columns [0, columns): Llama's arithmetic.

        Returns the logits and, per row, (argmax token, its log-probability) as float32. ``modules``: the
        projections through their modules (hooks apply) instead of the fused weights."""
        b, heads, kv, dim = rows, self.heads, self.kv_heads, self.head_dim
        group = heads // kv
        ids, pos = self.inputs[0, :b], self.inputs[1, :b]
        cos, sin = self.cos[pos], self.sin[pos]  # [b, heads + kv, dim]
        at = (self.heads_offset[:b] + pos[:, None]).view(-1)  # each (row, kv head)'s column in the flat cache
        hidden = self.columns[:columns].unsqueeze(0) > pos.unsqueeze(1)  # [b, columns]: not attended
        bias = torch.zeros((b, 1, 1, columns), dtype=self.dtype, device=self.device)
        bias = bias.masked_fill(hidden[:, None, None, :], float("-inf"))
        h = self.embed(ids)
        for layer, keys, values, (wqkv, bqkv), (wgu, bgu) in zip(self.layers, self.keys, self.values, self.qkv,
                                                                  self.gate_up):
            attn, mlp = layer.self_attn, layer.mlp
            x = _norm(layer.input_layernorm, h)
            if modules:
                qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1).view(b, heads + 2 * kv, dim)
            else:
                qkv = F.linear(x, wqkv, bqkv).view(b, heads + 2 * kv, dim)
            qk, v = qkv[:, : heads + kv], qkv[:, heads + kv:]
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head's queries and keys before RoPE
                qk = torch.cat([_norm(attn.q_norm, qk[:, :heads]), _norm(attn.k_norm, qk[:, heads:])], dim=1)
            swapped = qk.view(b, heads + kv, 2, dim // 2).flip(2).view(b, heads + kv, dim)
            qk = torch.addcmul(qk * cos, swapped, sin)
            keys.view(-1, dim).index_copy_(0, at, qk[:, heads:].reshape(b * kv, dim))
            values.view(-1, dim).index_copy_(0, at, v.reshape(b * kv, dim))
            q = qk[:, :heads].reshape(b, kv, group, dim)
            scores = torch.matmul(q, keys[:b, :, :columns].transpose(-1, -2)) + bias  # [b, kv, group, columns]
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            out = torch.matmul(probs, values[:b, :, :columns]).view(b, heads * dim)
            if modules:
                h = h + attn.o_proj(out)
                x = _norm(layer.post_attention_layernorm, h)
                h = h + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
                continue
            h = _add_linear(h, out, attn.o_proj)
            gate, up = F.linear(_norm(layer.post_attention_layernorm, h), wgu, bgu).chunk(2, dim=-1)
            h = _add_linear(h, mlp.act_fn(gate) * up, mlp.down_proj)
        logits = self.head(_norm(self.norm, h))
        top = logits.argmax(dim=-1, keepdim=True)
        logprob = torch.log_softmax(logits.float(), dim=-1).gather(1, top)
        return logits, torch.cat([top.float(), logprob], dim=1)
