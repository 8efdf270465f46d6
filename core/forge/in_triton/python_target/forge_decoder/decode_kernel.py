"""A decoding step's attention over the KV cache as one Triton kernel, the cache write included.

Through ``scaled_dot_product_attention`` a layer of the captured step launches at least three kernels: the
keys' write, the values' write and the attention over the whole column bucket with a mask (a paged cache first
gathers each row's blocks: one more copy). Here one program per (row, key/value head) takes the query heads
that share that key/value head and reads only the row's cached columns ``[0, position)`` — its static slot, or
its blocks through the row's block table — block by block (online softmax, float32 statistics); it adds the
new token's own key and value from registers and then writes them at the row's position. The write comes after
every read in the same program, and no other program reads that column (padding rows, at the spare column,
attend to themselves alone; shared prefix blocks are full, so a step never writes into one).

Triton ships with torch's CUDA wheels; where it is missing, or the kernel does not compile or does not match
the reference on this GPU (``check``), the decoder keeps SDPA. On a CPU the same kernel runs in Triton's
interpreter: what the tests check against SDPA and transformers.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the decoder keeps SDPA (available() says why)
    triton = tl = None

#: the reason this module cannot run here, or None
MISSING = None if triton is not None else "Triton is not installed"


def _add(a, b):
    return a + b


def _larger(a, b):
    return tl.maximum(a, b)


def _attend_and_write(q_ptr, k_ptr, v_ptr, keys_ptr, values_ptr, pos_ptr, table_ptr, out_ptr,
                      q_row, q_head, k_row, k_head, v_row, v_head, c_slot, c_head, c_col, t_row, o_row, spare,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr,
                      PAGE: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM)
    in_group = g < GROUP
    q = tl.load(q_ptr + row * q_row + (head * GROUP + g)[:, None] * q_head + d[None, :], mask=in_group[:, None],
                other=0.0)
    k = tl.load(k_ptr + row * k_row + head * k_head + d)
    v = tl.load(v_ptr + row * v_row + head * v_head + d)
    pos = tl.load(pos_ptr + row)
    length = tl.where(pos >= spare, 0, pos)  # cached columns this row attends to before its own
    # the new token first, from registers: running max, sum and weighted values of the online softmax
    m = tl.reduce(q.to(tl.float32) * k.to(tl.float32)[None, :], 1, _add)
    total = tl.full([GROUP_PAD], 1.0, tl.float32)
    acc = tl.full([GROUP_PAD, DIM], 0.0, tl.float32) + v.to(tl.float32)[None, :]
    offsets = tl.arange(0, BLOCK)
    for start in range(0, length, BLOCK):
        cols = start + offsets
        valid = cols < length
        if PAGE:  # each column's block from the row's table, its offset inside the block
            blocks = tl.load(table_ptr + row * t_row + cols // PAGE, mask=valid, other=0)
            at = blocks[:, None] * c_slot + head * c_head + (cols % PAGE)[:, None] * c_col + d[None, :]
        else:  # the row's own slot
            at = row * c_slot + head * c_head + cols[:, None] * c_col + d[None, :]
        keys = tl.load(keys_ptr + at, mask=valid[:, None], other=0.0)
        if IEEE:  # float32 models: no TF32 rounding of the scores
            scores = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(keys))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        top = tl.maximum(m, tl.reduce(scores, 1, _larger))
        fade = tl.exp(m - top)
        p = tl.exp(scores - top[:, None])
        total = total * fade + tl.reduce(p, 1, _add)
        values = tl.load(values_ptr + at, mask=valid[:, None], other=0.0)
        if IEEE:
            acc = acc * fade[:, None] + tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * fade[:, None] + tl.dot(p.to(values.dtype), values)
        m = top
    out = acc / total[:, None]
    tl.store(out_ptr + row * o_row + (head * GROUP + g)[:, None] * DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=in_group[:, None])
    if PAGE:
        own = tl.load(table_ptr + row * t_row + pos // PAGE) * c_slot + head * c_head + (pos % PAGE) * c_col
    else:
        own = row * c_slot + head * c_head + pos * c_col
    tl.store(keys_ptr + own + d, k)
    tl.store(values_ptr + own + d, v)


# the reductions' combine functions are Triton functions (tl.sum and tl.max are too, but the interpreter runs
# those only when TRITON_INTERPRET was set before Triton's import; tl.reduce calls these in either mode)
if triton is not None:
    _add, _larger = triton.jit(_add), triton.jit(_larger)
_compiled = triton.jit(_attend_and_write) if triton is not None else None
_interpreted = None  # built on first use on a CPU


def unsupported(heads: int, kv: int, dim: int, dtype: torch.dtype, page: int = 0) -> str | None:
    """Why the kernel cannot serve this attention shape (``page``: a paged cache's block size; 0: static slots)
    here (None: it can)."""
    if MISSING:
        return MISSING
    if dim < 16 or dim & (dim - 1):
        return f"its head dim {dim} is not a power of two of at least 16"
    if page and (page < 16 or page & (page - 1)):
        return f"its KV-cache blocks of {page} tokens are not a power of two of at least 16"
    if heads % kv:
        return f"{heads} query heads do not group over {kv} key/value heads"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype} is not float16, bfloat16 or float32"
    return None


def attend_and_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     pos: torch.Tensor, spare: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """Queries q [b, heads, dim] (scaled already) over each row's cached columns [0, pos) and over the row's own
    k, v [b, kv, dim], which are then written at column ``pos``. Static slots: ``keys`` / ``values`` [slots, kv,
    columns, dim], row i in slot i. Paged: ``keys`` / ``values`` [blocks, kv, block, dim] and ``table`` [rows,
    width], row i's column c in block ``table[i, c // block]``. Rows at ``spare`` attend to themselves alone.
    Returns [b, heads * dim]; inputs may be strided views whose last dimension is contiguous."""
    global _interpreted
    b, heads, dim = q.shape
    kv = k.shape[1]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((b, heads * dim), dtype=q.dtype, device=q.device)
    if q.device.type == "cuda":
        kernel = _compiled
    else:
        if _interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            _interpreted = InterpretedFunction(_attend_and_write)
        kernel = _interpreted
    group = heads // kv
    page = keys.shape[2] if table is not None else 0
    block = 64 if dim <= 64 else 32
    kernel[(b, kv)](q, k, v, keys, values, pos, pos if table is None else table, out,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    keys.stride(0), keys.stride(1), keys.stride(2), 0 if table is None else table.stride(0),
                    out.stride(0), spare,
                    GROUP=group, GROUP_PAD=max(16, 1 << math.ceil(math.log2(group))), DIM=dim,
                    BLOCK=block if not page else min(block, page), PAGE=page, IEEE=q.dtype == torch.float32)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              pos: torch.Tensor, spare: int, table: torch.Tensor | None = None) -> torch.Tensor:
    """``attend_and_write``'s result and cache writes, row by row through SDPA: what ``check`` compares with."""
    b, heads, dim = q.shape
    kv = k.shape[1]
    page = keys.shape[2]

    def where(row: int, cols: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # (slots or blocks, columns)
        if table is None:
            return torch.full((len(cols),), row), torch.tensor(cols)
        return table[row, [c // page for c in cols]].cpu(), torch.tensor([c % page for c in cols])

    out = []
    for row, at in enumerate(pos.tolist()):
        blocks, columns = where(row, [at])
        keys[blocks, :, columns], values[blocks, :, columns] = k[row:row + 1], v[row:row + 1]
        blocks, columns = where(row, [at] if at >= spare else list(range(at + 1)))
        seen_k, seen_v = keys[blocks, :, columns].transpose(0, 1), values[blocks, :, columns].transpose(0, 1)
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[row].reshape(kv, heads // kv, dim), seen_k, seen_v, scale=1.0))
    return torch.stack(out).reshape(b, heads * dim)


def check(heads: int, kv: int, dim: int, dtype: torch.dtype, device: torch.device, page: int = 0) -> str | None:
    """Run the kernel once on random inputs beside ``reference`` (static slots, or blocks of ``page`` tokens); why it
    cannot be used here (None: it can)."""
    reason = unsupported(heads, kv, dim, dtype, page)
    if reason:
        return reason
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        spare = 191
        table = None
        if page:  # rows' blocks shuffled over the pool
            width = spare // page + 1
            table = torch.randperm(4 * width, generator=gen).reshape(4, width).to(device)
            shape = (4 * width, kv, page, dim)
        else:
            shape = (5, kv, spare + 1, dim)
        cache = torch.randn((2, *shape), generator=gen).to(device, dtype)
        q = torch.randn((4, heads, dim), generator=gen).to(device, dtype) * dim ** -0.5
        kvnew = torch.randn((4, 2, kv, dim), generator=gen).to(device, dtype)
        pos = torch.tensor([0, 3, 130, spare], device=device)
        ours, theirs = cache.clone(), cache.clone()
        got = attend_and_write(q, kvnew[:, 0], kvnew[:, 1], ours[0], ours[1], pos, spare, table)
        want = reference(q, kvnew[:, 0], kvnew[:, 1], theirs[0], theirs[1], pos, spare, table)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        error = (got.float() - want.float()).abs().max().item()
        if not error <= tolerance or not torch.equal(ours, theirs):
            return f"its result differs from SDPA's on this device (max error {error:.3g})"
    except Exception as exc:  # no compiler, an unsupported GPU: SDPA is correct too
        return f"it failed here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None
