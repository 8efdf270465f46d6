"""Rank files: safetensors files sized and headed first, whose tensor bytes then arrive in any order.

A converted checkpoint's ``rank{N}.safetensors`` is laid out from its tensors' names and shapes before a
byte is written (:class:`RankWriter`), so the copy engine (:mod:`.transfer`) can write blocks from several
threads, or copy them file to file in the kernel, straight to their place.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .sharding import Piece, Planned
from .tensorio import NUMPY_TYPES, PAGE


def data_offsets(tensors: Sequence[tuple[str, tuple[int, ...]]], tag: str) -> dict[str, tuple[int, int]]:
    """Each tensor's (begin, end) in the data section of a safetensors file, in the given order."""
    size = np.dtype(NUMPY_TYPES[tag]).itemsize
    offsets, pos = {}, 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * size
        offsets[name], pos = (pos, pos + nbytes), pos + nbytes
    return offsets


# Rank-file writes go to the page cache at most this many bytes per call. A larger write lets the kernel
# back the file with larger folios, and on this VM those were far slower to fill, likely because they come
# from free memory the hypervisor has taken back (free page reporting works on 2 MiB blocks) and every
# first touch faults on the host. In-process tp 4, medians of two A/B runs of shuffled rounds: 2 MiB
# writes 2.79 s, 256 KiB 1.03 s, 64 KiB 1.24 s, 16 KiB 1.64 s (`cp` 0.72 s); 1 MiB 1.64 s, 512 KiB
# 0.98 s, 256 KiB 1.07 s, 128 KiB 1.19 s (`cp` 0.73 s). RELAY_BYTES (below) was sized with 2 MiB writes.
WRITE_BYTES = 512 << 10


class RankWriter:
    """A safetensors file whose header is written first and whose tensor bytes arrive in any order.

    ``page_residue`` places the data section at that offset modulo the page size (the JSON header
    is padded with spaces, which safetensors allows), so that blocks copied from a source file at
    the same residue move whole pages.
    """

    def __init__(self, path: Path, tensors: Sequence[tuple[str, tuple[int, ...]]], tag: str,
                 metadata: Mapping[str, str] | None = None, page_residue: int | None = None):
        self.path, self.tag = path, tag
        spans = data_offsets(tensors, tag)
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        for name, shape in tensors:
            header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": list(spans[name])}
        self.offsets = {name: begin for name, (begin, _) in spans.items()}
        blob = json.dumps(header, separators=(",", ":")).encode()
        self.data_start = _data_start(8 + len(blob), page_residue)
        blob += b" " * (self.data_start - 8 - len(blob))
        self.size = self.data_start + max((end for _, end in spans.values()), default=0)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(self.fd, struct.pack("<Q", len(blob)) + blob)
        _allocate(self.fd, self.size)

    def write(self, name: str, byte_offset: int, data: np.ndarray) -> None:
        """Write contiguous ``data`` at ``byte_offset`` inside tensor ``name``."""
        self._pwrite(memoryview(data).cast("B"), self.data_start + self.offsets[name] + byte_offset)

    def _pwrite(self, view: memoryview, pos: int) -> None:
        try:
            while view:
                done = os.pwrite(self.fd, view[:WRITE_BYTES], pos)
                view, pos = view[done:], pos + done
        except OSError as exc:  # named: a write has no file name of its own
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def copy(self, name: str, byte_offset: int, src_fd: int, src_offset: int, length: int) -> bool:
        """Copy ``length`` bytes of another file into tensor ``name`` inside the kernel.

        False (nothing written) where the kernel or file system cannot; the caller writes instead.
        """
        pos = self.data_start + self.offsets[name] + byte_offset
        try:
            while length:
                done = os.copy_file_range(src_fd, self.fd, length, src_offset, pos)
                if done == 0:
                    raise OSError("copy_file_range copied nothing")
                src_offset, pos, length = src_offset + done, pos + done, length - done
        except OSError as exc:
            if pos != self.data_start + self.offsets[name] + byte_offset:  # not retried as a write of the whole block
                raise OSError(exc.errno, exc.strerror or str(exc), str(self.path)) from None
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)


def _allocate(fd: int, size: int) -> None:
    """Size the file, its blocks allocated up front where the file system can (``fallocate(2)``).

    Writing into allocated blocks skips ext4's per-page delayed-allocation work: the in-kernel
    copies of a 2.2 GB export took about 10% less time (measured), and a full disk fails here,
    before anything is copied. glibc's ``posix_fallocate`` would instead write every block where
    the file system lacks fallocate, so the system call is made directly; elsewhere the file is
    sized sparse, as before.
    """
    import ctypes  # already loaded by numpy

    try:
        fallocate = ctypes.CDLL(None, use_errno=True).fallocate
    except AttributeError:  # not glibc/Linux
        fallocate = None
    if fallocate is not None:
        fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        if fallocate(fd, 0, 0, size) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))
    os.ftruncate(fd, size)


def _data_start(least: int, page_residue: int | None) -> int:
    """The first offset from ``least`` that is 8-byte aligned and ≡ ``page_residue`` modulo the page size."""
    if page_residue is None or page_residue % 8:
        return -(-least // 8) * 8
    return least + (page_residue - least) % PAGE


def copy_alignment(tensors: Sequence[Planned], tag: str) -> int | None:
    """Where a rank file's data section should start (modulo the page size) for its in-kernel copies.

    A block whose source and destination offsets differ by a multiple of the page size is copied
    as whole pages (about 7% less kernel time than through partial ones, measured); one padding
    serves one residue, so it goes to the one with the most bytes. None when nothing is copied. The
    same padding whether or not copies run in the kernel: the rank files never depend on
    FORGE_EXPORT_IN_KERNEL.
    """
    spans = data_offsets([(t.name, t.shape) for t in tensors], tag)
    weight: dict[int, int] = {}
    for planned in tensors:
        row_bytes = math.prod(planned.shape[1:]) * np.dtype(NUMPY_TYPES[tag]).itemsize
        row = 0
        for piece in planned.pieces:
            rows = piece.rows[1] - piece.rows[0]
            if _copyable(piece, tag):
                source = piece.ref.begin + piece.rows[0] * row_bytes
                residue = (source - spans[planned.name][0] - row * row_bytes) % PAGE
                weight[residue] = weight.get(residue, 0) + rows * row_bytes
            row += rows
    return max(weight, key=weight.__getitem__) if weight else None


def _copyable(piece: Piece, tag: str) -> bool:
    """Whether the piece's bytes are a source file's bytes unchanged (whole rows, same dtype)."""
    ref = piece.ref
    return (ref is not None and ref.tag == tag and piece.cols is None and not piece.transpose
            and hasattr(ref.file, "byte_range"))
