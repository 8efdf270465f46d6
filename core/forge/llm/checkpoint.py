"""Hugging Face decoder checkpoint → TensorRT-LLM unified checkpoint, streamed tensor by tensor.

The output directory holds ``config.json`` and one ``rank{N}.safetensors`` per GPU (rank =
pp_rank·tp + tp_rank), with the tensor names and layouts TensorRT-LLM's loader expects. Source
tensors are memory-mapped and cut into per-rank row blocks that are converted and written straight
to their place in pre-sized rank files, so peak memory stays at a few chunks whatever the model size.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from forge import __version__
from forge.components import Artifact
from forge.errors import ForgeError, UsageError

from .adapter import COLUMN, QKV, REPLICATE, ROW, VOCAB, DecoderAdapter, Weight

ARTIFACT_KIND = "trtllm-checkpoint"
DTYPE_TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # numpy has no bfloat16: raw bits
_READABLE = {**_NUMPY, "F64": np.float64, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32,
             "I64": np.int64, "F8_E4M3": np.uint8}  # quantized checkpoints (read by the reference model)
_BITS = {"F32": (np.uint32, 0x7FFFFFFF, 0x7F800000), "F16": (np.uint16, 0x7FFF, 0x7C00),
         "BF16": (np.uint16, 0x7FFF, 0x7F80)}  # (view type, abs mask, exponent-all-ones)
CHUNK_BYTES = 16 << 20  # rows are converted and written in blocks of about this size
_PAGE = mmap.PAGESIZE


# -- dtype handling (numpy only: the converter never imports torch) -------------------------------

def to_float32(a: np.ndarray, tag: str) -> np.ndarray:
    """``a`` (stored as ``tag``) as float32."""
    if tag == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def from_float32(a: np.ndarray, tag: str) -> np.ndarray:
    """float32 ``a`` as ``tag`` (bfloat16 rounded to nearest even, NaN kept NaN)."""
    if tag == "BF16":
        bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
        nan = (bits & 0x7FFFFFFF) > 0x7F800000
        if nan.any():
            rounded[nan] = 0x7FC0
        return rounded
    return a.astype(_NUMPY[tag])


class Scratch:
    """Reusable named buffers: chunk-sized temporaries without a fresh (page-faulting) allocation per chunk."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def take(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.size < nbytes:
            buf = self._bufs[key] = np.empty(nbytes, dtype=np.uint8)
        return buf[:nbytes].view(dtype).reshape(shape)


def convert(a: np.ndarray, src: str, dst: str, scratch: Scratch | None = None) -> np.ndarray:
    """``a`` converted from dtype tag ``src`` to ``dst``, C-contiguous (a view when nothing changes).

    Non-finite inputs may come out as any non-finite value; callers refuse them anyway.
    """
    if src == dst and a.flags.c_contiguous:
        return a
    s = scratch or Scratch()
    out = s.take("out", a.shape, _NUMPY[dst])
    if src == "BF16":  # widen the raw bits: bfloat16 is the top half of a float32
        wide = s.take("mid", a.shape, np.uint32)
        np.copyto(wide, a, casting="unsafe")
        np.left_shift(wide, 16, out=wide)
        a, src = wide.view(np.float32), "F32"
        if dst == "F32":
            return a
    if dst == "BF16":  # round to nearest even on the float32 bits
        if src == "F32":
            bits = np.ascontiguousarray(a).view(np.uint32)
        else:
            bits = s.take("mid", a.shape, np.float32)
            np.copyto(bits, a, casting="unsafe")
            bits = bits.view(np.uint32)
        tmp = s.take("tmp", a.shape, np.uint32)
        np.right_shift(bits, 16, out=tmp)
        np.bitwise_and(tmp, 1, out=tmp)
        np.add(tmp, 0x7FFF, out=tmp)
        np.add(tmp, bits, out=tmp)
        np.right_shift(tmp, 16, out=tmp)
        np.copyto(out, tmp, casting="unsafe")
        return out
    with np.errstate(over="ignore"):  # overflow shows up as Inf and is reported by the caller
        np.copyto(out, a, casting="unsafe")
    return out


def nonfinite(a: np.ndarray, tag: str, scratch: Scratch | None = None) -> bool:
    """True when ``a`` holds a NaN or ±Inf (tested on the bit pattern, any dtype tag)."""
    if a.size == 0:
        return False
    view, mask, inf = _BITS[tag]
    masked = scratch.take("mask", a.shape, view) if scratch is not None else None
    return bool(np.bitwise_and(a.view(view), view(mask), out=masked).max() >= inf)


# -- reading --------------------------------------------------------------------------------------

@dataclass(eq=False)
class TensorRef:
    """Where one source tensor lives: its file, dtype tag, shape and byte range."""

    name: str
    tag: str
    shape: tuple[int, ...]
    file: "SafetensorsFile | TorchFile"
    begin: int = 0
    end: int = 0

    def array(self) -> np.ndarray:
        """A zero-copy (memory-mapped) numpy view of the tensor."""
        return self.file.array(self)

    def release(self, rows: tuple[int, int] | None = None) -> None:
        """Drop the mapped pages of the tensor (or of rows ``rows``) from this process's memory.

        The page cache keeps them, so a later read is a cheap refault, not disk I/O.
        """
        if rows is None:
            self.file.release(self.begin, self.end)
            return
        row_bytes = (self.end - self.begin) // max(1, self.shape[0]) if self.shape else 0
        self.file.release(self.begin + rows[0] * row_bytes, self.begin + rows[1] * row_bytes)


class SafetensorsFile:
    """A memory-mapped safetensors file whose tensors are read as numpy views."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.data_start = 8 + length
        self.metadata = header.pop("__metadata__", None) or {}
        self.refs = {name: TensorRef(name, info["dtype"], tuple(info["shape"]), self,
                                     self.data_start + info["data_offsets"][0],
                                     self.data_start + info["data_offsets"][1])
                     for name, info in header.items()}

    def array(self, ref: TensorRef) -> np.ndarray:
        if ref.tag not in _READABLE:
            raise UsageError(f"{self.path.name}: tensor {ref.name} has dtype {ref.tag}, which forge cannot read")
        count = int(np.prod(ref.shape, dtype=np.int64))
        return np.frombuffer(self._mm, dtype=_READABLE[ref.tag], count=count, offset=ref.begin).reshape(ref.shape)

    def release(self, begin: int, end: int) -> None:
        start = begin - begin % _PAGE
        if end > start and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:  # a numpy view is still alive; the map closes when it is collected
            pass


class TorchFile:
    """A pickle checkpoint (only with --allow-pickle), loaded memory-mapped with weights_only."""

    _TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

    def __init__(self, path: Path):
        import torch

        self.path = path
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
        self._tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        self.refs = {name: TensorRef(name, self._TAGS.get(str(t.dtype).removeprefix("torch."), str(t.dtype)),
                                     tuple(t.shape), self) for name, t in self._tensors.items()}

    def array(self, ref: TensorRef) -> np.ndarray:
        import torch

        if ref.tag not in _NUMPY:
            raise UsageError(f"{self.path.name}: tensor {ref.name} has dtype {ref.tag}, which forge cannot read")
        t = self._tensors[ref.name].contiguous()
        return (t.view(torch.int16).numpy().view(np.uint16) if ref.tag == "BF16" else t.numpy())

    def release(self, begin: int, end: int) -> None:
        pass

    def close(self) -> None:
        self._tensors.clear()


class SourceIndex:
    """Every tensor of a (possibly sharded) checkpoint, by name."""

    def __init__(self, files: Sequence[Path], weight_format: str = "safetensors"):
        opener = SafetensorsFile if weight_format == "safetensors" else TorchFile
        self.files = [opener(Path(f)) for f in files]
        self.refs: dict[str, TensorRef] = {}
        for f in self.files:
            self.refs.update(f.refs)

    def __enter__(self) -> "SourceIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self.files:
            f.close()

    def find(self, name: str, prefixes: Sequence[str]) -> TensorRef | None:
        """The tensor called ``prefix + name`` for the first prefix that exists."""
        for prefix in prefixes:
            ref = self.refs.get(prefix + name)
            if ref is not None:
                return ref
        return None


# -- validation -----------------------------------------------------------------------------------

_REQUIRED = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_size", "vocab_size",
             "intermediate_size", "max_position_embeddings")


def check_config(adapter: DecoderAdapter, norm: Mapping[str, Any], where: str,
                 hf_config: Mapping[str, Any] | None = None) -> None:
    """Refuse configs that lack a size TensorRT-LLM needs, use a feature it lacks, or whose heads do not fit."""
    for key, (value, why) in adapter.unsupported.items():
        if hf_config is not None and key in hf_config and hf_config[key] == value:
            raise UsageError(f"{where}: config.json sets {key}={json.dumps(value)}, which TensorRT-LLM cannot "
                             f"build: {why}")
    for name in _REQUIRED:
        value = norm.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            keys = " or ".join(adapter.config_fields.get(name, ())) or name
            raise UsageError(f"{where}: config.json has no usable {keys} ({name}); got {value!r}")
    if norm["num_heads"] % norm["num_kv_heads"]:
        raise UsageError(f"{where}: {norm['num_heads']} attention heads are not a multiple of "
                         f"{norm['num_kv_heads']} key/value heads")


def check_parallelism(norm: Mapping[str, Any], tp: int, pp: int, where: str, uneven_pp: bool = True) -> None:
    """Refuse tensor/pipeline splits that TensorRT-LLM cannot build, with the reason.

    ``uneven_pp=False`` (TensorRT-LLM before 0.11) also refuses layer counts that pp does not divide.
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
                         "before 0.11 drops the remainder", hint="choose a pp that divides the layer count")


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
        if ref.tag not in _NUMPY:
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

class RankWriter:
    """A safetensors file whose header is written first and whose tensor bytes arrive in any order."""

    def __init__(self, path: Path, tensors: Sequence[tuple[str, tuple[int, ...]]], tag: str,
                 metadata: Mapping[str, str] | None = None):
        self.path, self.tag = path, tag
        size = np.dtype(_NUMPY[tag]).itemsize
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, int] = {}
        pos = 0
        for name, shape in tensors:
            nbytes = int(np.prod(shape, dtype=np.int64)) * size
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.offsets[name] = pos
            pos += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self.data_start = 8 + len(blob)
        self.size = self.data_start + pos
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self.fd, struct.pack("<Q", len(blob)) + blob)
        os.ftruncate(self.fd, self.size)

    def write(self, name: str, byte_offset: int, data: np.ndarray) -> None:
        """Write contiguous ``data`` at ``byte_offset`` inside tensor ``name``."""
        view = memoryview(data).cast("B")
        pos = self.data_start + self.offsets[name] + byte_offset
        while view:
            done = os.pwrite(self.fd, view, pos)
            view, pos = view[done:], pos + done

    def close(self) -> None:
        os.close(self.fd)


def _blocks(piece: Piece, cols_hint: int) -> Iterator[tuple[int, np.ndarray | None, int]]:
    """(first output row, source block, number of rows) blocks of about CHUNK_BYTES."""
    n = piece.rows[1] - piece.rows[0]
    step = max(1, CHUNK_BYTES // max(1, cols_hint * 4))
    if piece.ref is None:
        for s in range(0, n, step):
            yield s, None, min(step, n - s)
        return
    src = piece.ref.array()
    if piece.transpose:
        src = src.T
    for s in range(0, n, step):
        rows = (piece.rows[0] + s, piece.rows[0] + min(n, s + step))
        block = src[rows[0]:rows[1]]
        if piece.cols is not None:
            block = block[:, piece.cols[0]:piece.cols[1]]
        yield s, block, block.shape[0]
        if not piece.transpose:  # rows of a transposed view are strided over the whole source
            piece.ref.release(rows)  # keeps a huge embedding from becoming resident as a whole


def _signature(planned: Planned) -> tuple:
    return planned.name, planned.shape, tuple((p.ref.name if p.ref else None, p.rows, p.cols, p.transpose)
                                              for p in planned.pieces)


def _chunks(planned: Planned, tag: str) -> Iterator[tuple[int, Piece, np.ndarray | None, int]]:
    """(byte offset in the tensor, piece, source block or None for zeros, rows) of one rank tensor."""
    row_elems = int(np.prod(planned.shape[1:], dtype=np.int64)) if len(planned.shape) > 1 else 1
    row_bytes = row_elems * np.dtype(_NUMPY[tag]).itemsize
    row = 0
    for piece in planned.pieces:
        for first, block, rows in _blocks(piece, row_elems):
            yield (row + first) * row_bytes, piece, block, rows
        row += piece.rows[1] - piece.rows[0]


def write_job(job: Job, writers: Mapping[int, RankWriter], tag: str, where: str,
              scratch: Scratch | None = None) -> int:
    """Convert and write one tensor to every rank that holds it; returns the bytes written.

    Ranks holding identical copies (embeddings, norms, row-parallel biases) share one conversion,
    and the ranks' blocks are visited in lockstep so rows that several ranks slice (row-parallel
    weights) are read while resident and released once.
    """
    scratch = scratch or Scratch()
    groups: dict[tuple, list[int]] = {}
    for rank, planned in job.per_rank.items():
        groups.setdefault(_signature(planned), []).append(rank)
    streams = [(job.per_rank[ranks[0]], ranks, _chunks(job.per_rank[ranks[0]], tag)) for ranks in groups.values()]
    written = 0
    for step in itertools.zip_longest(*(stream for _, _, stream in streams)):
        for (planned, ranks, _), item in zip(streams, step):
            if item is None:
                continue
            offset, piece, block, rows = item
            if block is None:
                out = np.zeros((rows, *planned.shape[1:]), dtype=_NUMPY[tag])
            else:
                out = convert(block, piece.ref.tag, tag, scratch)
                if nonfinite(out, tag, scratch):
                    if nonfinite(block, piece.ref.tag):
                        raise UsageError(f"{where}: tensor {piece.ref.name} contains NaN or Inf values; "
                                         "the checkpoint is corrupt or was saved after a diverged step")
                    raise UsageError(f"{where}: tensor {piece.ref.name} has values beyond the {tag} range",
                                     hint="export with --dtype bfloat16 or float32")
            for rank in ranks:
                writers[rank].write(planned.name, offset, out)
                written += out.nbytes
    for ref in job.sources:
        ref.release()
    return written


# -- the export stage -----------------------------------------------------------------------------

def trtllm_config(adapter: DecoderAdapter, norm: Mapping[str, Any], dtype: str, tp: int, pp: int,
                  quantization: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The TensorRT-LLM ``config.json`` of a converted checkpoint."""
    config = {
        "producer": {"name": "forge", "version": __version__},
        "architecture": adapter.trtllm_architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": norm["vocab_size"],
        "max_position_embeddings": norm["max_position_embeddings"],
        "hidden_size": norm["hidden_size"],
        "num_hidden_layers": norm["num_layers"],
        "num_attention_heads": norm["num_heads"],
        "num_key_value_heads": norm["num_kv_heads"],
        "head_size": norm["head_size"],
        "intermediate_size": norm["intermediate_size"],
        "hidden_act": norm["hidden_act"],
        "norm_epsilon": norm["norm_epsilon"],
        # Embeddings are whole on every first-stage rank and lm_head is its own (vocab-split) tensor.
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "tie_word_embeddings": False,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": dict(quantization or {"quant_algo": None, "kv_cache_quant_algo": None}),
    }
    config.update(adapter.trtllm_config(norm))
    return config


def checkpoint_meta(adapter: DecoderAdapter, norm: Mapping[str, Any], hf_architecture: str, dtype: str,
                    tp: int, pp: int, source: Path) -> dict[str, Any]:
    """The artifact metadata later stages (quantize, compile, emit_config) read."""
    return {
        "family": adapter.family,
        "architecture": adapter.trtllm_architecture,
        "hf_architecture": hf_architecture,
        "dtype": dtype,
        "tp": tp, "pp": pp, "world_size": tp * pp,
        "vocab_size": norm["vocab_size"],
        "vocab_size_padded": -(-norm["vocab_size"] // tp) * tp,
        "hidden_size": norm["hidden_size"],
        "num_layers": norm["num_layers"],
        "num_heads": norm["num_heads"],
        "num_kv_heads": norm["num_kv_heads"],
        "head_size": norm["head_size"],
        "intermediate_size": norm["intermediate_size"],
        "max_position_embeddings": norm["max_position_embeddings"],
        "hidden_act": norm["hidden_act"],
        "pp_layers": [list(stage_layers(norm["num_layers"], pp, s)) for s in range(pp)],
        # Mistral-style sliding-window attention is a runtime setting of TensorRT-LLM (max_attention_window)
        "sliding_window": norm.get("sliding_window"),
        "source": str(Path(source).resolve()),
        "quant": {},
    }


def convert_checkpoint(adapter: DecoderAdapter, config: Mapping[str, Any], weight_files: Sequence[Path],
                       out: Path, *, dtype: str, tp: int, pp: int, weight_format: str = "safetensors",
                       prefixes: Sequence[str] | None = None, where: str = "checkpoint",
                       log: Callable[[str], None] = lambda m: None, write: bool = True,
                       uneven_pp: bool = True) -> dict[str, Any]:
    """Convert a checkpoint (config dict + weight files) into ``out``; return the normalized config.

    With ``write=False`` only the checks run (config, parallelism, every tensor's name, dtype and
    shape, read from the headers), which is what ``--dry-run`` does.
    """
    if dtype not in DTYPE_TAGS:
        raise UsageError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPE_TAGS)}")
    architecture = (config.get("architectures") or [""])[0]
    if not adapter.accepts(architecture):
        raise UsageError(f"{where}: architecture {architecture or '(none in config.json)'!r} is not supported by "
                         f"family {adapter.family!r}; supported: {', '.join(adapter.architectures)}")
    norm = adapter.normalize(config)
    check_config(adapter, norm, where, config)
    check_parallelism(norm, tp, pp, where, uneven_pp)
    tag = DTYPE_TAGS[dtype]
    with SourceIndex(weight_files, weight_format) as index:
        jobs = plan(adapter, norm, tp, pp, index, prefixes, where)
        if not write:
            return norm
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(trtllm_config(adapter, norm, dtype, tp, pp), indent=2))
        layouts: dict[int, list[tuple[str, tuple[int, ...]]]] = {r: [] for r in range(tp * pp)}
        for job in jobs:
            for rank, planned in job.per_rank.items():
                layouts[rank].append((planned.name, planned.shape))
        writers = {r: RankWriter(out / f"rank{r}.safetensors", layouts[r], tag) for r in layouts}
        try:
            total = 0
            scratch = Scratch()
            for job in jobs:
                total += write_job(job, writers, tag, where, scratch)
        finally:
            for w in writers.values():
                w.close()
    log(f"wrote {tp * pp} rank file(s), {total / 2**20:.1f} MiB of {dtype} weights")
    return norm


def export(adapter: DecoderAdapter, source: Path, ctx, *, hf_config: Mapping[str, Any] | None = None,
           prefixes: Sequence[str] | None = None) -> Artifact:
    """The export stage: a TensorRT-LLM unified checkpoint in ``ctx.workdir/checkpoint``.

    ``hf_config`` and ``prefixes`` let composite families (a decoder inside a multimodal checkpoint)
    reuse the converter with the inner text config and the inner weight-name prefix.
    """
    from forge.hf import inspect_checkpoint

    from .engine import UNEVEN_PP, parse_version

    spec = ctx.spec
    source = Path(source)
    checkpoint = inspect_checkpoint(source, allow_pickle=spec.allow_pickle,
                                    trust_remote_code=spec.trust_remote_code)
    config = dict(hf_config or checkpoint.config)
    out = ctx.workdir / "checkpoint"
    norm = convert_checkpoint(adapter, config, checkpoint.weight_files, out, dtype=spec.dtype, tp=spec.tp,
                              pp=spec.pp, weight_format=checkpoint.weight_format, prefixes=prefixes,
                              where=str(source), log=ctx.log, write=not ctx.dry_run,
                              uneven_pp=parse_version(spec.backend_version) >= UNEVEN_PP)
    architecture = (config.get("architectures") or [""])[0]
    meta = checkpoint_meta(adapter, norm, architecture, spec.dtype, spec.tp, spec.pp, source)
    ctx.note("export", {"format": "tensorrt-llm unified checkpoint", "architecture": meta["architecture"],
                        "dtype": spec.dtype, "tp": spec.tp, "pp": spec.pp,
                        "tied_lm_head": bool(norm.get("tie_word_embeddings")),
                        "vocab_padded_to": meta["vocab_size_padded"]})
    if ctx.option("parity", False) and not ctx.dry_run:
        check_parity(adapter, source, out, spec.dtype, ctx)
    return Artifact(ARTIFACT_KIND, out, meta)


#: Relative logit tolerance of an export, per dtype, as a multiple of the adapter's float32 tolerance.
PARITY_SCALE = {"float32": 1.0, "float16": 100.0, "bfloat16": 500.0}
PARITY_TOKENS = 16


def check_parity(adapter: DecoderAdapter, source: Path, checkpoint_dir: Path, dtype: str, ctx) -> dict[str, Any]:
    """``-o parity=true``: compare the rank files' logits (numpy reference) with transformers'.

    Loads the whole model twice (transformers and the reference), so it is meant for small models.
    """
    import torch
    import transformers

    from .reference import ReferenceModel, max_abs_diff

    config = json.loads((checkpoint_dir / "config.json").read_text())
    ids = [(7 * i + 3) % config["vocab_size"] for i in range(PARITY_TOKENS)]
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                              trust_remote_code=ctx.spec.trust_remote_code)
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].float().numpy()
    del model
    got = ReferenceModel(checkpoint_dir).logits(ids)
    scale = max(1.0, float(np.abs(expected).max()))
    relative = max_abs_diff(got, expected) / scale
    tolerance = ctx.option("parity_tolerance") or adapter.parity_tolerance * PARITY_SCALE[dtype]
    result = {"tokens": len(ids), "max_abs_diff": round(relative * scale, 6), "relative": relative,
              "tolerance": tolerance, "argmax_agreement": float((got.argmax(-1) == expected.argmax(-1)).mean())}
    ctx.note("parity", result)
    if relative > tolerance:
        raise ForgeError(f"exported checkpoint's logits differ from transformers by {relative:.3g} (relative to "
                         f"max |logit| {scale:.3g}), above the tolerance {tolerance:g}",
                         hint="this is a converter bug for this checkpoint; please report it with --debug output")
    return result
