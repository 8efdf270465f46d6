"""A batch of per-sequence KV caches kept as one left-padded Hugging Face cache.

Continuous batching needs rows to join and leave between decoding steps. Every row's keys and
values sit right-aligned in one ``[rows, heads, length, head_dim]`` tensor per layer; a row that
is shorter than the batch is padded on the left and masked out by ``mask``. Joining pads the
shorter side, leaving drops rows and then the columns no remaining row uses.
"""

from __future__ import annotations

import torch

try:  # transformers ≥ 4.56 keeps a list of layer objects, older versions two lists of tensors
    from transformers.cache_utils import DynamicCache, DynamicLayer
except ImportError:  # pragma: no cover - very old transformers
    from transformers.cache_utils import DynamicCache

    DynamicLayer = None


if DynamicLayer is not None:

    class GrowableLayer(DynamicLayer):
        """A dynamic cache layer that grows its buffer geometrically instead of on every token.

        The stock layer concatenates on every step, copying the whole cache each time; this one
        keeps spare capacity and writes in place, returning views of the used part.
        """

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            self._k = self._v = None
            self._used = 0

        def _ensure(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
            if self._k is not None and self._k.shape[-2] >= need and self._k.shape[0] == like_k.shape[0]:
                return
            capacity = max(need, 16, int(need * 1.5))
            k = like_k.new_zeros((*like_k.shape[:-2], capacity, like_k.shape[-1]))
            v = like_v.new_zeros((*like_v.shape[:-2], capacity, like_v.shape[-1]))
            if self._k is not None and self._used:
                k[..., : self._used, :] = self._k[..., : self._used, :]
                v[..., : self._used, :] = self._v[..., : self._used, :]
            self._k, self._v = k, v

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            need = self._used + key_states.shape[-2]
            self._ensure(need, key_states, value_states)
            self._k[..., self._used: need, :] = key_states
            self._v[..., self._used: need, :] = value_states
            self._used = need
            self.keys, self.values = self._k[..., :need, :], self._v[..., :need, :]
            return self.keys, self.values

        def assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Replace the contents (after a row selection, padding or trimming)."""
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
            self._k, self._v = None, None
            self._used = 0
            self._ensure(keys.shape[-2], keys, values)
            self._k[..., : keys.shape[-2], :] = keys
            self._v[..., : values.shape[-2], :] = values
            self._used = keys.shape[-2]
            self.keys, self.values = self._k[..., : self._used, :], self._v[..., : self._used, :]


def new_cache() -> DynamicCache:
    """An empty cache whose layers grow in place (a plain DynamicCache on old transformers)."""
    cache = DynamicCache()
    if DynamicLayer is not None and getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:
        cache.layer_class_to_replicate = GrowableLayer
    return cache


def layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), ``[rows, kv heads, length, head dim]``."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # pragma: no cover - transformers < 4.56


def _set(cache: DynamicCache, tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, tensors):
            if DynamicLayer is not None and isinstance(layer, GrowableLayer):
                layer.assign(k, v)
            else:
                layer.keys, layer.values = k, v
        return
    cache.key_cache = [k for k, _ in tensors]  # pragma: no cover - transformers < 4.56
    cache.value_cache = [v for _, v in tensors]  # pragma: no cover


class BatchCache:
    """The KV cache of the running batch and its ``[rows, length]`` attention mask."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor):
        self.cache = cache
        self.mask = mask  # 1 where a row has a real token, 0 for left padding

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def extend_mask(self) -> torch.Tensor:
        """The mask for one more token per row (what the next decoding step attends to)."""
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.rows, 1))], dim=1)
        return self.mask

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then drop columns that are padding in every row."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.length
        self.mask = self.mask[:, start:]
        _set(self.cache, [(k.index_select(0, index)[:, :, start:, :],
                           v.index_select(0, index)[:, :, start:, :]) for k, v in layers(self.cache)])

    def merge(self, other: "BatchCache") -> None:
        """Append ``other``'s rows, left-padding whichever side is shorter."""
        length = max(self.length, other.length)

        def pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            if n == 0:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        a, b = layers(self.cache), layers(other.cache)
        _set(self.cache, [(torch.cat([pad(ka, length - self.length, 2), pad(kb, length - other.length, 2)]),
                           torch.cat([pad(va, length - self.length, 2), pad(vb, length - other.length, 2)]))
                          for (ka, va), (kb, vb) in zip(a, b)])
        self.mask = torch.cat([pad(self.mask, length - self.length, 1), pad(other.mask, length - other.length, 1)])
