"""Tensor- and pipeline-parallel planning: which slice of which source tensor each rank file holds.

:func:`plan` turns an adapter's weight declarations into jobs (one per TensorRT-LLM tensor, with the
rows each rank takes); :func:`stage_layers` is the pipeline split; :func:`check_parallelism`
refuses splits TensorRT-LLM cannot build.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


from forge.errors import ForgeError, UsageError

from .adapter import COLUMN, QKV, REPLICATE, ROW, VOCAB, DecoderAdapter, Weight
from .tensorio import NUMPY_TYPES, SourceIndex, TensorRef

def check_parallelism(norm: Mapping[str, Any], tp: int, pp: int, where: str, uneven_pp: bool = True) -> None:
    """Refuse tensor/pipeline splits that TensorRT-LLM cannot build, with the reason.

    ``uneven_pp=False`` (TensorRT-LLM before 1.0) also refuses layer counts that pp does not divide.
    """
    heads, kv, layers = norm["num_heads"], norm["num_kv_heads"], norm["num_layers"]
    if heads % tp:
        raise UsageError(f"{where}: {heads} attention heads cannot be split over --tp {tp}; "
                         f"choose a tp that divides {heads}")
    if kv < tp and tp % kv:
        raise UsageError(f"{where}: --tp {tp} is not a multiple of the {kv} key/value heads; with fewer KV "
                         f"heads than ranks each head is duplicated, so tp must be a multiple of {kv}")
    if kv >= tp and kv % tp:
        raise UsageError(f"{where}: {kv} key/value heads cannot be split over --tp {tp}; "
                         f"choose a tp that divides {kv}")
    if pp > layers:
        raise UsageError(f"{where}: --pp {pp} asks for more pipeline stages than the model's {layers} layers")
    if layers % pp and not uneven_pp:
        raise UsageError(f"{where}: {layers} layers cannot be split evenly over --pp {pp}, and TensorRT-LLM "
                         "before 1.0 gives every stage layers // pp layers (the engine would lose the rest)",
                         hint="choose a pp that divides the layer count, or --backend-version v1.0.0")


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layers of pipeline stage ``stage``: even split, the first ``num_layers % pp`` stages get one more."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


# -- planning -------------------------------------------------------------------------------------

@dataclass
class Piece:
    """A block of output rows: rows ``rows`` (and columns ``cols``) of a source, or zero rows."""

    ref: TensorRef | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    transpose: bool = False


@dataclass
class Planned:
    """One tensor of one rank file: its name, shape and the pieces it is stacked from."""

    name: str
    shape: tuple[int, ...]
    pieces: list[Piece]


@dataclass
class Job:
    """One TensorRT-LLM tensor across all ranks that hold it; its sources are read once."""

    label: str
    per_rank: dict[int, Planned] = field(default_factory=dict)
    sources: list[TensorRef] = field(default_factory=list)


class _Planner:
    def __init__(self, adapter: DecoderAdapter, norm: Mapping[str, Any], tp: int, pp: int,
                 index: SourceIndex, prefixes: Sequence[str], where: str):
        self.adapter, self.norm, self.tp, self.pp = adapter, norm, tp, pp
        self.index, self.prefixes, self.where = index, prefixes, where
        self.missing: list[str] = []
        self.tied_used = False

    def dims(self, shape: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(int(self.norm[d]) for d in shape)

    def source(self, name: str, expected: tuple[int, ...], weight: str) -> TensorRef | None:
        ref = self.index.find(name, self.prefixes)
        if ref is None:
            if self.prefixes[0] + name not in self.missing:
                self.missing.append(self.prefixes[0] + name)
            return None
        if ref.tag not in NUMPY_TYPES:
            raise UsageError(f"{self.where}: tensor {ref.name} has dtype {ref.tag}; forge converts floating-point "
                             "checkpoints (F32, F16, BF16) only", hint="export from the unquantized checkpoint")
        if ref.shape != expected:
            raise UsageError(f"{self.where}: tensor {ref.name} has shape {list(ref.shape)} but config.json "
                             f"implies {list(expected)} for {weight}; the config does not match the weights")
        return ref

    def job(self, key: str, w: Weight, layer: int | None, local: int | None, stages: list[int]) -> Job | None:
        if w.when and not self.norm.get(w.when):
            return None
        name = key if layer is None else f"transformer.layers.{local}.{key}"  # local index in its stage
        label = key if layer is None else f"transformer.layers.{layer}.{key}"
        shape = self.dims(w.shape)
        src = w.source
        if w.tied and self.norm.get("tie_word_embeddings"):
            src, self.tied_used = w.tied, True  # tied: the embedding is what transformers uses
        fmt = (lambda s: s.format(i=layer)) if layer is not None else (lambda s: s)
        if isinstance(src, tuple):  # separate Q, K, V
            n, kv = self.norm["q_dim"], self.norm["kv_dim"]
            rest = shape[1:]
            refs = [self.source(fmt(s), (rows, *rest), label) for s, rows in zip(src, (n, kv, kv))]
        else:
            expected = tuple(reversed(shape)) if w.transpose else shape
            refs = [self.source(fmt(src), expected, label)]
        if any(r is None for r in refs):
            return None
        job = Job(label, sources=refs)
        for stage in stages:
            for tp_rank in range(self.tp):
                job.per_rank[stage * self.tp + tp_rank] = self.rank_tensor(name, w, shape, refs, tp_rank, label)
        return job

    def rank_tensor(self, name: str, w: Weight, shape: tuple[int, ...], refs: list[TensorRef],
                    r: int, label: str) -> Planned:
        tp, t = self.tp, w.transpose
        if w.split == REPLICATE or tp == 1 and w.split != QKV:
            return Planned(name, shape, [Piece(refs[0], (0, shape[0]), None, t)])
        if w.split == COLUMN:
            n = self._divide(shape[0], w.shape[0], label)
            return Planned(name, (n, *shape[1:]), [Piece(refs[0], (r * n, (r + 1) * n), None, t)])
        if w.split == ROW:
            n = self._divide(shape[1], w.shape[1], label)
            return Planned(name, (shape[0], n), [Piece(refs[0], (0, shape[0]), (r * n, (r + 1) * n), t)])
        if w.split == VOCAB:
            n = -(-shape[0] // tp)  # vocab padded up to a multiple of tp
            start, stop = min(r * n, shape[0]), min((r + 1) * n, shape[0])
            pieces = [Piece(refs[0], (start, stop), None, t)]
            if stop - start < n:
                pieces.append(Piece(None, (0, n - (stop - start))))
            return Planned(name, (n, *shape[1:]), pieces)
        if w.split == QKV:
            return self.qkv(name, shape, refs, r, t)
        raise ForgeError(f"unknown split {w.split!r} for {label}")  # adapter bug, not user input

    def qkv(self, name: str, shape: tuple[int, ...], refs: list[TensorRef], r: int, t: bool) -> Planned:
        d, kv, tp = self.norm["head_size"], self.norm["num_kv_heads"], self.tp
        q_dim, kv_dim = self.norm["q_dim"], self.norm["kv_dim"]
        q_rows = q_dim // tp
        if kv >= tp:
            kv_rows = kv_dim // tp
            kv_start = r * kv_rows
        else:  # fewer KV heads than ranks: rank r gets (a copy of) KV head r·kv/tp
            kv_rows = d
            kv_start = (r * kv // tp) * d
        if len(refs) == 3:
            q, k, v = refs
            offsets = (0, 0, 0)
        else:
            q = k = v = refs[0]
            offsets = (0, q_dim, q_dim + kv_dim)
        pieces = [Piece(q, (offsets[0] + r * q_rows, offsets[0] + (r + 1) * q_rows), None, t),
                  Piece(k, (offsets[1] + kv_start, offsets[1] + kv_start + kv_rows), None, t),
                  Piece(v, (offsets[2] + kv_start, offsets[2] + kv_start + kv_rows), None, t)]
        return Planned(name, (q_rows + 2 * kv_rows, *shape[1:]), pieces)

    def _divide(self, size: int, dim: str, label: str) -> int:
        if size % self.tp:
            raise UsageError(f"{self.where}: {dim} {size} of {label} cannot be split over --tp {self.tp}; "
                             f"choose a tp that divides {size}")
        return size // self.tp

    def plan(self) -> list[Job]:
        a, pp = self.adapter, self.pp
        jobs: list[Job | None] = []
        jobs += [self.job(k, w, None, None, [0]) for k, w in a.first_stage_weights.items()]
        for stage in range(pp):
            for local, layer in enumerate(stage_layers(self.norm["num_layers"], pp, stage)):
                jobs += [self.job(k, w, layer, local, [stage]) for k, w in a.layer_weights.items()]
        jobs += [self.job(k, w, None, None, [pp - 1]) for k, w in a.last_stage_weights.items()]
        if self.missing:
            shown = ", ".join(self.missing[:6]) + (f" (+{len(self.missing) - 6} more)" if len(self.missing) > 6 else "")
            raise UsageError(f"{self.where}: the checkpoint lacks {len(self.missing)} tensor(s) TensorRT-LLM needs: "
                             f"{shown}")
        return [j for j in jobs if j is not None]


def plan(adapter: DecoderAdapter, norm: Mapping[str, Any], tp: int, pp: int, index: SourceIndex,
         prefixes: Sequence[str] | None = None, where: str = "checkpoint") -> list[Job]:
    """Every output tensor of every rank, in file order, with the source blocks it is made of."""
    return _Planner(adapter, norm, tp, pp, index, prefixes or adapter.weight_prefixes, where).plan()


# -- writing --------------------------------------------------------------------------------------

