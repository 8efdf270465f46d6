"""The static decoder's bfloat16 GEMMs on a CPU through oneDNN, each weight reordered once at load.

``F.linear`` hands oneDNN a plain row-major weight, which it reorders into its blocked layout on every call; a
weight reordered once (``torch.ops.mkldnn._reorder_linear_weight``, the packing ``torch.compile``'s CPU backend
uses) skips that. On a 2-core AVX512-BF16 EPYC (SmolLM2-135M's shapes) a GEMM took 0.55-0.75x the time at 1, 8
and 32 rows, with the same bits out. bfloat16 only: packed float32 weights accumulate in another order (about
1e-4 apart), which would move the greedy ids off transformers' in float32.

The packed weights are copies: the plain ones stay for the modules (LoRA hooks, the Hugging Face forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: the rows a weight is packed for (oneDNN's blocking hint; any number of rows runs on it)
PACK_ROWS = 32
#: at most this share of the available host memory goes to the packed copies
MEMORY_SHARE = 0.25


class Packed:
    """One linear layer's weight packed for oneDNN, and its bias: ``packed(x)`` is ``F.linear(x, weight, bias)``
    (any leading dimensions)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def unpackable(weights: list[torch.Tensor], available: int | None) -> str | None:
    """Why ``weights`` cannot be packed here (None: they can): on a CPU, bfloat16, oneDNN there and agreeing with
    ``F.linear`` on a probe, and the copies within MEMORY_SHARE of the ``available`` host memory."""
    first = weights[0]
    if first.device.type != "cpu":
        return "not on a CPU"
    if first.dtype != torch.bfloat16:
        return f"{first.dtype} (bfloat16 only)"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return "this torch has no oneDNN weight packing"
    size = sum(w.numel() * w.element_size() for w in weights)
    if available is not None and size > available * MEMORY_SHARE:
        return f"the packed copies ({size / 2**30:.1f} GiB) would take over a quarter of the available memory"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn((96, 64), generator=generator).to(torch.bfloat16)
    x = torch.randn((3, 64), generator=generator).to(torch.bfloat16)
    try:
        same = torch.equal(Packed(weight)(x), F.linear(x, weight))
    except RuntimeError as exc:
        return f"oneDNN refused a probe: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    return None if same else "a packed probe differs from F.linear"
