"""The decoding step's attention over the KV cache, in the form the decoder chose at load (``graphs.ATTENTION``).

* ``fused`` (a GPU): decode_kernel's Triton kernel writes the step's keys and values and attends, one launch.
* ``cpu`` (a CPU): cpu_kernels' C kernel writes the keys and values and reads each row's columns up to its
  position.
* ``sdpa``: written, then ``scaled_dot_product_attention`` over the column bucket with a mask (a paged cache
  gathers each row's blocks first).
* ``matmul``: written, then scores, softmax and the weighted sum as three ops (what the tests compare against).

``auto`` takes fused on a GPU and cpu on a CPU where they run here, else sdpa; the log says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_kernels, decode_kernel

FORMS = ("auto", "fused", "cpu", "sdpa", "matmul")


def choose(asked: str, heads: int, kv: int, dim: int, dtype: torch.dtype, device: torch.device, cache):
    """(form, note for the log, cpu_kernels' library or None) for an ``ATTENTION`` value; asking for a kernel
    that cannot run here is an error."""
    if asked not in FORMS:
        raise ValueError(f"attention {asked!r}: expected one of {', '.join(FORMS)}")
    if asked in ("sdpa", "matmul"):
        return asked, asked, None
    cpu = asked == "cpu" or asked == "auto" and device.type == "cpu"
    library = None
    if cpu:
        library, reason = cpu_kernels.load()
        reason = reason or cpu_kernels.unsupported(heads, kv, dim, dtype)
    elif asked == "auto" and device.type != "cuda":
        reason = "not on a GPU"
    else:
        reason = decode_kernel.check(heads, kv, dim, dtype, device, cache.block if cache.paged else 0)
    if reason is None:
        return ("cpu", "cpu (forge's C kernel)", library) if cpu else (
            "fused", "fused (one Triton kernel writes and attends)", None)
    if asked != "auto":
        raise ValueError(f"the {asked} decoding attention cannot run here: {reason}")
    return "sdpa", f"sdpa (not the {'CPU' if cpu else 'fused'} kernel: {reason})", None


def where(decoder, pos: torch.Tensor, columns: int):
    """Where a step writes and attends: the positions alone (fused, cpu: the kernels write), else (flat cache rows
    to write, the attention bias ``[b, 1, 1, columns]``)."""
    if decoder.attention in ("fused", "cpu"):
        return pos
    at = decoder.cache.step_index(pos)  # each (row, kv head)'s row in the flat cache
    hidden = decoder.columns[:columns].unsqueeze(0) > pos.unsqueeze(1)  # [b, columns]: not attended
    bias = torch.zeros((pos.shape[0], 1, 1, columns), dtype=decoder.dtype, device=decoder.device)
    return at, bias.masked_fill(hidden[:, None, None, :], float("-inf"))


def attend(decoder, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where, columns: int) -> torch.Tensor:
    """graphs.GraphDecoder._attend in the decoder's form."""
    cache = decoder.cache
    table = cache.table if cache.paged else None
    if decoder.attention == "fused":  # each row's columns up to its position: ``columns`` is only a bound
        return decode_kernel.attend_and_write(q, k, v, cache.keys[layer], cache.values[layer], where,
                                              decoder.spare, table)
    b, kv, dim = k.shape
    q = q.reshape(b, kv, decoder.heads // kv, dim)  # a key/value head's query group: SDPA's "query length"
    if decoder.attention == "cpu":  # ``where``: the positions; the kernel writes the keys and values itself
        new = (k, v) if cpu_kernels.writes(k, v) else None
        if new is None:
            cache.write_step(layer, cache.step_index(where), k, v)
        return cpu_kernels.attend(decoder.cpu_kernel, q, cache.keys[layer], cache.values[layer], where, columns,
                                    table, new)
    at, mask = where
    cache.write_step(layer, at, k, v)
    keys, values = cache.read(layer, b, columns)
    if decoder.attention == "sdpa":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0).reshape(b, -1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) + mask  # [b, kv, group, columns]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(decoder.dtype)
    return torch.matmul(probs, values).view(b, -1)
