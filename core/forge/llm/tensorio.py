"""Tensor I/O of decoder checkpoints: memory-mapped safetensors and pickle files, dtype conversion.

Reading never loads a whole file: :class:`SafetensorsFile` maps it and hands out row blocks;
:class:`TorchFile` reads the (opt-in) pickle format through torch. Conversions between float32,
float16 and bfloat16 work on raw bits in reusable scratch buffers (numpy has no bfloat16).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from forge.errors import UsageError

DTYPE_TAGS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
NUMPY_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # numpy has no bfloat16: raw bits
_READABLE = {**NUMPY_TYPES, "F64": np.float64, "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32,
             "I64": np.int64, "F8_E4M3": np.uint8}  # quantized checkpoints (read by the reference model)
_BITS = {"F32": (np.int32, np.uint32, 0x7F800000), "F16": (np.int16, np.uint16, 0x7C00),
         "BF16": (np.int16, np.uint16, 0x7F80)}  # (signed view, unsigned view, exponent all ones)
# nonfinite reads this many elements at a time (a relay's 2 MiB piece of float16 in one part). Each numpy call
# hands the GIL to another thread and back, and those handoffs cost between busy lanes: tp 4 in-process 0.81
# vs 0.89 s median with 128 Ki (0.82 s with 512 Ki), tp 1 even, `cp` 0.67 s (8 shuffled rounds).
_CHECK_ELEMS = 1 << 20
CHUNK_BYTES = 16 << 20  # rows are converted and written in blocks of about this size
PAGE = mmap.PAGESIZE
_FAULT_AROUND = 2 << 20  # how far from a faulting page Linux may map cached pages (a large folio)


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
    return a.astype(NUMPY_TYPES[tag])


class Scratch:
    """Reusable named buffers: chunk-sized temporaries without a fresh (page-faulting) allocation per chunk."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def take(self, key: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
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
    out = s.take("out", a.shape, NUMPY_TYPES[dst])
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


def nonfinite(a: np.ndarray, tag: str) -> bool:
    """True when ``a`` holds a NaN or ±Inf (tested on the bit pattern, any dtype tag).

    Two max-reductions and no temporary array: read as signed integers, positive NaN/Inf are the
    largest values; read as unsigned ones, the negative NaN/Inf are.
    """
    if a.size == 0:
        return False
    signed, unsigned, inf = _BITS[tag]
    negative_inf = inf | (1 << (8 * np.dtype(signed).itemsize - 1))
    flat = a.reshape(-1) if a.flags.c_contiguous else None
    parts = (flat[i:i + _CHECK_ELEMS] for i in range(0, flat.size, _CHECK_ELEMS)) if flat is not None else (a,)
    return any(p.view(signed).max() >= inf or p.view(unsigned).max() >= negative_inf for p in parts)


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
        count = math.prod(ref.shape)
        return np.frombuffer(self._mm, dtype=_READABLE[ref.tag], count=count, offset=ref.begin).reshape(ref.shape)

    def release(self, begin: int, end: int) -> None:
        # A fault also maps cached pages around it, beyond the bytes read (fault-around, and the rest
        # of a large page-cache folio, up to 2 MiB): those are dropped too, or every block would leave
        # some mapped behind and the peak would grow with the model (+12 MiB per 11 layers at tp 4).
        start = max(0, begin - _FAULT_AROUND)
        start -= start % PAGE
        end = min(len(self._mm), end + _FAULT_AROUND)
        if end > start and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def byte_range(self, block: np.ndarray) -> tuple[int, int] | None:
        """(file offset, length) of ``block`` when it is a contiguous view into this file, else None.

        Such a block can be copied file to file inside the kernel (``os.copy_file_range``) instead
        of through this process.
        """
        if not block.flags.c_contiguous:
            return None
        return self.extent(block)

    def extent(self, block: np.ndarray) -> tuple[int, int] | None:
        """(file offset, length) of the bytes a view into this file spans (a strided view's too), else None."""
        if block.base is None or block.size == 0 or any(step < 0 for step in block.strides):
            return None
        start = block.__array_interface__["data"][0] - self._address()
        length = sum((n - 1) * step for n, step in zip(block.shape, block.strides)) + block.itemsize
        if start < 0 or start + length > len(self._mm):
            return None
        return start, length

    def _address(self) -> int:
        if not hasattr(self, "_base"):
            self._base = np.frombuffer(self._mm, dtype=np.uint8, count=1).__array_interface__["data"][0]
        return self._base

    def fileno(self) -> int:
        """A read descriptor of the file (for in-kernel copies), opened on first use."""
        if getattr(self, "_fd", None) is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None
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

        if ref.tag not in NUMPY_TYPES:
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


