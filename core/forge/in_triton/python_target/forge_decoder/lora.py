"""Multi-LoRA serving: TensorRT-LLM's per-request adapters on a transformers model.

A request names its adapter with ``lora_task_id`` and, the first time, carries it as ``lora_weights``
[num_lora_modules_layers, D×Hi + Ho×D] and ``lora_config`` [num_lora_modules_layers, 3] = (module id, layer,
D): per row the flattened ``in`` matrix [D, Hi], then the flattened ``out`` matrix [Ho, D] with the adapter's
scaling already folded in. As in tensorrtllm_backend, the adapter is then cached under its task id, later
requests send only the id, an unknown id without weights is that request's error, and the cache is bounded
(``lora_cache_host_memory_bytes``) with the least recently used adapter evicted first. An adapter a running
sequence uses stays alive for that sequence even when the cache evicts it.

Requests with different adapters (and none) share one batch: forward hooks on the target modules add, for
each adapter present in the batch, ``x[rows] @ Aᵀ @ Bᵀ`` to the outputs of the rows that use it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from .request import GenerationRequest, RequestError

WEIGHTS_FILE, CONFIG_FILE = "model.lora_weights.npy", "model.lora_config.npy"


@dataclass(eq=False)
class Adapter:
    """One adapter on the model's device: (module id, layer) → (A [D, Hi], B [Ho, D])."""

    deltas: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]
    task_id: int | None = None
    nbytes: int = 0
    rank: int = 0


@dataclass
class LoraModules:
    """The model's LoRA-capable modules with hooks that apply each batch row's adapter."""

    model: Any
    modules: Mapping[int, str]  # TensorRT-LLM module id → module path, ``{i}`` = layer
    shapes: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # → (Hi, Ho)
    groups: list[tuple[Adapter, torch.Tensor | None]] | None = None  # per adapter of the batch: its rows (None: all)

    def __post_init__(self) -> None:
        config = self.model.config
        layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
        for module_id, template in self.modules.items():
            for layer in range(layers):
                module = self.model.get_submodule(template.format(i=layer))
                if hasattr(module, "in_features"):  # nn.Linear
                    shape = (int(module.in_features), int(module.out_features))
                else:  # transformers' Conv1D (GPT-2) keeps its weight as [in, out]
                    shape = (int(module.weight.shape[0]), int(module.weight.shape[1]))
                self.shapes[(int(module_id), layer)] = shape
                module.register_forward_hook(self._hook((int(module_id), layer)))

    def select(self, rows: list[Adapter | None] | None) -> None:
        """The adapter of every row of the next forward pass (None: the base model).

        The rows of each adapter are gathered here, once per forward pass, not in every hooked module.
        """
        self.groups = None
        if not rows or all(a is None for a in rows):
            return
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, adapter in enumerate(rows):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(i)
        device = next(self.model.parameters()).device
        self.groups = [(adapter, None if len(index) == len(rows) else torch.tensor(index, device=device))
                       for adapter, index in groups.values()]

    def _hook(self, key: tuple[int, int]) -> Callable:
        def apply(module, inputs, output):
            if self.groups is None:
                return None
            x = inputs[0]
            for adapter, index in self.groups:
                pair = adapter.deltas.get(key)
                if pair is None:
                    continue
                a, b = pair
                if index is None:  # one adapter for the whole batch: no gather
                    output = output + ((x.to(a.dtype) @ a.T) @ b.T).to(output.dtype)
                else:
                    delta = (x.index_select(0, index).to(a.dtype) @ a.T) @ b.T
                    output = output.index_add(0, index, delta.to(output.dtype))
            return output
        return apply


def _squeeze(value: np.ndarray, ndim: int, name: str) -> np.ndarray:
    value = np.asarray(value)
    while value.ndim > ndim and value.shape[0] == 1:
        value = value[0]
    if value.ndim != ndim:
        raise RequestError(f"input {name!r} must be {'[rows, D×Hi + Ho×D]' if ndim == 2 else '[rows, 3]'} "
                           f"for one adapter, got shape {list(value.shape)}")
    return value


class AdapterCache:
    """Adapters by task id, least recently used evicted first beyond ``capacity_bytes`` of weights."""

    def __init__(self, modules: LoraModules, *, capacity_bytes: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, log: Callable[[str], None] = print):
        self.modules = modules
        self.capacity_bytes = capacity_bytes
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.log = log
        self.entries: OrderedDict[int, Adapter] = OrderedDict()
        self.evictions = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.entries.values())

    def build(self, weights: np.ndarray, config: np.ndarray, task_id: int | None = None) -> Adapter:
        """Check one adapter's ``lora_weights`` / ``lora_config`` against this model and load it."""
        weights = _squeeze(weights, 2, "lora_weights")
        config = _squeeze(config, 2, "lora_config").astype(np.int64)
        if config.shape[0] != weights.shape[0] or config.shape[1] < 3:
            raise RequestError(f"lora_config {list(config.shape)} must be [rows, 3] with one row per lora_weights row "
                               f"({weights.shape[0]})")
        if config.shape[1] > 3 and np.any(config[:, 3:] != 0):
            raise RequestError("lora_config marks DoRA modules (4th column); this model serves LoRA only")
        deltas: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        nbytes = rank = 0
        for n, (module_id, layer, d) in enumerate(config[:, :3].tolist()):
            key = (int(module_id), int(layer))
            if key not in self.modules.shapes:
                ids = sorted({m for m, _ in self.modules.shapes})
                layers = 1 + max(l for _, l in self.modules.shapes)
                raise RequestError(f"lora_config row {n}: module id {module_id} at layer {layer} is not a LoRA module "
                                   f"of this model (module ids {ids}, layers 0–{layers - 1})")
            if key in deltas:
                raise RequestError(f"lora_config row {n}: module id {module_id} at layer {layer} appears twice")
            if d < 1 or d > self.max_rank:
                raise RequestError(f"lora_config row {n}: adapter size {d} is outside 1…{self.max_rank} "
                                   "(lora_cache_max_adapter_size)")
            hi, ho = self.modules.shapes[key]
            if d * (hi + ho) > weights.shape[1]:
                raise RequestError(f"lora_weights row {n} has {weights.shape[1]} values; module id {module_id} at rank "
                                   f"{d} needs {d * (hi + ho)} ({d}×{hi} + {ho}×{d})")
            row = np.asarray(weights[n], dtype=np.float32)
            if not np.isfinite(row[:d * (hi + ho)]).all():
                raise RequestError(f"lora_weights row {n} holds NaN or infinity")
            a = torch.as_tensor(row[:d * hi].reshape(d, hi), dtype=self.dtype, device=self.device)
            b = torch.as_tensor(row[d * hi:d * (hi + ho)].reshape(ho, d), dtype=self.dtype, device=self.device)
            deltas[key] = (a, b)
            nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
            rank = max(rank, d)
        if not deltas:
            raise RequestError("lora_weights / lora_config hold no rows")
        return Adapter(deltas, task_id, nbytes, rank)

    def put(self, task_id: int, adapter: Adapter) -> None:
        if adapter.nbytes > self.capacity_bytes:
            raise RequestError(f"LoRA task {task_id} needs {adapter.nbytes} bytes, more than the whole adapter cache "
                               f"(lora_cache_host_memory_bytes {self.capacity_bytes})")
        self.entries.pop(task_id, None)
        while self.entries and self.nbytes + adapter.nbytes > self.capacity_bytes:
            evicted, _ = self.entries.popitem(last=False)
            self.evictions += 1
            self.log(f"LoRA cache full: evicted task {evicted}")
        self.entries[task_id] = adapter

    def resolve(self, task_id: int | None, weights: np.ndarray | None, config: np.ndarray | None) -> Adapter | None:
        """The adapter of one request row (None: the base model), with tensorrtllm_backend's semantics."""
        if (weights is None) != (config is None):
            raise RequestError("lora_weights and lora_config must be sent together")
        if weights is not None:
            adapter = self.build(weights, config, task_id)
            if task_id is not None:
                self.put(task_id, adapter)
            return adapter
        if task_id is None:
            return None
        adapter = self.entries.get(task_id)
        if adapter is None:
            raise RequestError(f"LoRA task {task_id} not found in cache. Please send LoRA weights with request")
        self.entries.move_to_end(task_id)
        return adapter

    def resolve_rows(self, rows: list[GenerationRequest]) -> None:
        """Attach each row's adapter (rows of one request sending the same weights share one)."""
        built: dict[int, Adapter | None] = {}
        for row in rows:
            key = id(row.lora_weights) if row.lora_weights is not None else None
            if key is not None and key in built:
                row.lora = built[key]
                continue
            row.lora = self.resolve(row.lora_task_id, row.lora_weights, row.lora_config)
            if key is not None:
                built[key] = row.lora

    def prefetch(self, directory: Path) -> list[int]:
        """Load ``<directory>/<task id>/model.lora_{weights,config}.npy`` (tensorrtllm_backend's lora_prefetch_dir)."""
        loaded = []
        if not directory.is_dir():
            raise ValueError(f"lora_prefetch_dir {directory} is not a directory")
        for sub in sorted((p for p in directory.iterdir() if p.is_dir()), key=lambda p: p.name):
            if not sub.name.isdigit():
                raise ValueError(f"lora_prefetch_dir {directory}: folder {sub.name!r} is not a task id (digits only)")
            task_id = int(sub.name)
            try:
                adapter = self.build(np.load(sub / WEIGHTS_FILE), np.load(sub / CONFIG_FILE), task_id)
                self.put(task_id, adapter)
            except (OSError, RequestError) as exc:
                raise ValueError(f"lora_prefetch_dir {sub}: {exc}") from None
            loaded.append(task_id)
        return loaded


def from_parameters(model, parameter: Callable[[str, str], str], *, dtype: torch.dtype, device: torch.device,
                    here: Path, log: Callable[[str], None] = print) -> AdapterCache | None:
    """The model's adapter cache from its config parameters (None: it was built without LoRA modules)."""
    text = parameter("lora_modules", "")
    if not text:
        return None
    modules = LoraModules(model, {int(k): v for k, v in json.loads(text).items()})
    cache = AdapterCache(modules, capacity_bytes=int(parameter("lora_cache_host_memory_bytes", str(1 << 30))),
                         max_rank=int(parameter("lora_cache_max_adapter_size", "64")), dtype=dtype, device=device,
                         log=log)
    prefetch = parameter("lora_prefetch_dir", "")
    if prefetch:
        path = Path(prefetch) if Path(prefetch).is_absolute() else here.parent / prefetch
        loaded = cache.prefetch(path)
        log(f"LoRA: loaded task ids {loaded} from {path}")
    return cache
