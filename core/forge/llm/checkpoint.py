"""Hugging Face decoder checkpoint → TensorRT-LLM unified checkpoint, streamed tensor by tensor.

The output directory holds ``config.json`` and one ``rank{N}.safetensors`` per GPU (rank =
pp_rank·tp + tp_rank), with the tensor names and layouts TensorRT-LLM's loader expects. Source
tensors are memory-mapped (:mod:`.tensorio`) and cut into per-rank row blocks (:mod:`.sharding`)
that are converted and written straight to their place in pre-sized rank files, so peak memory
stays at a few chunks whatever the model size. The parity check lives in :mod:`.parity`.
"""

from __future__ import annotations

import errno
import gc
import itertools
import json
import math
import os
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from forge import __version__
from forge.components import Artifact
from forge.errors import UsageError

from .adapter import DecoderAdapter
from .decoder_parity import check_parity
from .sharding import Job, Piece, Planned, check_parallelism, plan, stage_layers
from .tensorio import CHUNK_BYTES, DTYPE_TAGS, NUMPY_TYPES, PAGE, Scratch, SourceIndex, TensorRef, convert, nonfinite

ARTIFACT_KIND = "trtllm-checkpoint"

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


# Tensors whose bytes do not change (same dtype) go to the rank files off the converting thread:
# file to file in the kernel, or relayed (see Transfers); set FORGE_EXPORT_IN_KERNEL=0 to send every
# byte through the converting thread instead (to compare, or on a system whose copy_file_range misbehaves).
_IN_KERNEL = hasattr(os, "copy_file_range") and os.environ.get("FORGE_EXPORT_IN_KERNEL", "1") != "0"


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
    row_elems = math.prod(planned.shape[1:])
    row_bytes = row_elems * np.dtype(NUMPY_TYPES[tag]).itemsize
    row = 0
    for piece in planned.pieces:
        # a column slice's block spans whole source rows (its relay reads them all): sized by those,
        # so that one relay job reads about a chunk of the source, not tp chunks
        spans_rows = piece.ref is not None and piece.cols is not None and not piece.transpose
        for first, block, rows in _blocks(piece, piece.ref.shape[-1] if spans_rows else row_elems):
            yield (row + first) * row_bytes, piece, block, rows
        row += piece.rows[1] - piece.rows[0]


def _unchanged_span(piece: Piece, block: np.ndarray | None, out: np.ndarray) -> tuple[int, int, int] | None:
    """(source fd, offset, length) when ``out`` is ``block`` itself: bytes that can be copied file to file."""
    if block is None or out is not block or not _IN_KERNEL:
        return None
    source = piece.ref.file
    if not hasattr(source, "byte_range"):
        return None
    span = source.byte_range(block)
    return None if span is None else (source.fileno(), *span)


class Rows(NamedTuple):
    """``count`` rows of ``stride`` bytes at byte ``start`` of a source file."""

    start: int
    stride: int
    count: int


def _column_slice(piece: Piece, block: np.ndarray | None, tag: str) -> tuple[Rows, int, int] | None:
    """(the source rows, first byte in a row, bytes per row) when ``block`` is a column slice of a file's
    rows in the output dtype: its bytes need not pass through the converting thread."""
    if (block is None or piece.cols is None or piece.transpose or piece.ref.tag != tag or block.ndim != 2
            or not _IN_KERNEL):
        return None
    source = piece.ref.file
    extent = source.extent(block) if hasattr(source, "extent") else None
    if extent is None or block.strides[1] != block.itemsize:
        return None
    stride = block.strides[0]
    start = piece.ref.begin + (extent[0] - piece.ref.begin) // stride * stride
    return Rows(start, stride, block.shape[0]), extent[0] - start, block.shape[1] * block.itemsize


def _refuse_nonfinite(out: np.ndarray, block: np.ndarray, ref: TensorRef, tag: str, where: str) -> None:
    """Refuse a converted block with NaN/Inf: corrupt weights, or values beyond the range of ``tag``."""
    if not nonfinite(out, tag):
        return
    if out is block or nonfinite(block, ref.tag):
        raise UsageError(f"{where}: tensor {ref.name} contains NaN or Inf values; "
                         "the checkpoint is corrupt or was saved after a diverged step")
    raise UsageError(f"{where}: tensor {ref.name} has values beyond the {tag} range",
                     hint="export with --dtype bfloat16 or float32")


_AHEAD = 256  # queued copies and checks the main thread may be ahead by (about a kilobyte each)
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # usable here


def core_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache"), default: int = 1 << 20) -> int:
    """The size of one core's L2 cache (Linux sysfs), within 256 KiB–2 MiB; ``default`` where unknown."""
    for cache in sorted(caches.glob("index*")):
        try:
            if (cache / "level").read_text().strip() != "2":
                continue
            text = (cache / "size").read_text().strip()
            size = int(text[:-1]) << {"K": 10, "M": 20}[text[-1]]
        except (OSError, ValueError, KeyError, IndexError):
            break
        return min(max(size, 256 << 10), 2 << 20)
    return default


# A lane reads source bytes this many at a time, so that they are still in its core's cache when it
# checks and writes them (tp 4 here: 2 MiB, the L2 size, 7% faster than 1 MiB; 3 MiB 30% slower).
RELAY_BYTES = core_cache_bytes()


# At tp 1 on two or more cores, whole rows can go either way (see Transfers), and which is faster depends on
# the host's phase: an export times PROBE_BYTES each way once TIME_AFTER bytes went (copies speed up over the
# first few hundred MiB on the host measured, cp's too: fresh page-cache pages), again after every
# RETIME_BYTES, and relays until the next timing only where relaying was RELAY_MARGIN times faster (the kernel
# way does less work per byte; where both are close it is kept). A timing drains the queue four times.
PROBE_BYTES = 64 << 20
TIME_AFTER = 256 << 20
RETIME_BYTES = 4 << 30
RELAY_MARGIN = 1.2
KERNEL, RELAY = "in the kernel", "relayed"


def faster_way(rates: Mapping[str, float]) -> str:
    """The way to take after a timing of both (bytes per second each): the relay only where it was
    ``RELAY_MARGIN`` times faster, since the kernel way does less work per byte."""
    return RELAY if rates[RELAY] > RELAY_MARGIN * rates[KERNEL] else KERNEL


class Transfers:
    """Blocks whose bytes do not change, written and checked off the converting (main) thread.

    Whole rows go one of two ways. *In the kernel*: one thread copies them file to file (``copy_file_range``)
    and another reads them again for the NaN/Inf check. *Relayed*: lanes (threads, at most one per core,
    taking jobs from one queue, each the next when it is free, so they end together) read a block's source
    rows once, a cache-sized piece at a time, check the piece there and write it to each rank file of its job;
    rows that several ranks hold (embeddings) make one job per lane. With one core only the kernel way is
    left; at tp > 1 the lanes relay (each rank file would otherwise be copied on one thread). At tp 1 neither
    way is faster in every phase of the host this was measured on (in its memory-bound phases relaying made
    0.71× ``cp`` where the kernel way made 1.63×, session 12; in its fast phases relaying was erratic, sessions
    8 and 10): an export times both ways as it goes (``_time``) and relays where that was much faster.
    Column slices (row-parallel weights at tp > 1) are always relayed, all ranks' slices in one job, so the
    rows are read once. The main thread meanwhile converts and writes the blocks whose bytes change.
    ``finish`` waits for all, or raises the first failure; ``close`` drops what has not started and waits for
    the rest (before the rank files are closed). Every design tried, with its numbers: benchmarks/CONVERSION.md.
    """

    def __init__(self, writers: Mapping[int, RankWriter]):
        self._progress = threading.Condition(threading.Lock())
        self._failed: list[BaseException] = []
        self._given = self._ended = 0  # jobs given (main thread) and ended (under ``_progress``)
        self._ahead = None  # while the main thread waits: the number of queued jobs it waits for
        self._buffers = _Buffers()
        self._lanes = _Crew("forge-relay", min(max(len(writers), 2), _CORES), self.ended)
        self._crews = [self._lanes]
        ways = [KERNEL] if _CORES == 1 else [KERNEL, RELAY] if len(writers) == 1 else [RELAY]
        self._choosing = len(ways) > 1
        self.way = ways[0]  # where choosing: until the first timing
        self._probe: list[tuple[str, int]] = []  # (way, bytes) segments left to time
        self._timing: list[float] | None = None  # [start, bytes given] of the segment being timed
        self._timed: dict[str, list[float]] = {}  # way → [bytes, seconds] of its segments in the timing under way
        self.rates: dict[str, float] = {}  # way → bytes per second in the latest complete timing
        self._untimed_bytes = RETIME_BYTES - TIME_AFTER  # given since the latest timing (none yet: TIME_AFTER)
        self._copier = self._checker = None
        if KERNEL in ways:
            self._copier = self._lanes if self._lanes.size == 1 else _Crew("forge-copy", 1, self.ended)
            self._checker = _Crew("forge-check", 1, self.ended)
            self._crews += [crew for crew in (self._copier, self._checker) if crew is not self._lanes]

    def copy(self, targets: Sequence[tuple[RankWriter, str, int]], block: np.ndarray, ref: TensorRef,
             span: tuple[int, int, int], tag: str, where: str) -> None:
        """Write ``block`` (whole rows, ``span`` of its source file) to each (writer, tensor, byte offset), checked."""
        if self._way(span[2] * len(targets)) == RELAY:  # contiguous: "rows" of one element, pieces of RELAY_BYTES
            size = block.itemsize
            self.relay([(writer, name, offset, 0, size) for writer, name, offset in targets], ref,
                       Rows(span[1], size, span[2] // size), tag, where)
            return
        for writer, name, offset in targets:
            self._give(self._copier, _copy, writer, name, offset, block, ref, span)
        self._give(self._checker, _check, block, ref, span, tag, where)

    def _way(self, size: int) -> str:
        """The way the next ``size`` bytes of whole rows go (both ways possible: see ``_time``)."""
        if self._choosing:
            self._time(size)
        return self._probe[0][0] if self._probe else self.way

    def _time(self, size: int) -> None:
        """Times the ways when due: half the kernel's bytes, the relay's, the kernel's other half, each segment
        from the queue drained to the queue drained. Timed in this order, a steady drift in the host's speed
        falls on both ways alike."""
        if self._probe and self._timing is not None and self._timing[1] >= self._probe[0][1]:
            self._wait(0)
            start, done = self._timing
            timed = self._timed.setdefault(self._probe.pop(0)[0], [0, 0.0])
            timed[0] += done
            timed[1] += time.perf_counter() - start
            self._timing = None
            if not self._probe:
                self.rates = {way: done / max(seconds, 1e-9) for way, (done, seconds) in self._timed.items()}
                self.way = faster_way(self.rates)
        if not self._probe and self._untimed_bytes >= RETIME_BYTES:
            self._probe = [(KERNEL, PROBE_BYTES // 2), (RELAY, PROBE_BYTES), (KERNEL, PROBE_BYTES // 2)]
            self._timed = {}
            self._untimed_bytes = 0
        if self._probe:
            if self._timing is None:
                self._wait(0)
                self._timing = [time.perf_counter(), 0]
            self._timing[1] += size
        else:
            self._untimed_bytes += size

    def relay(self, targets: Sequence[tuple[RankWriter, str, int, int, int]], ref: TensorRef, rows: Rows,
              tag: str, where: str) -> None:
        """Write bytes ``col`` to ``col + width`` of each of ``rows`` to each (writer, tensor, byte offset, col,
        width), end to end, checked once."""
        lanes = self._lanes.size if all(width == rows.stride for *_, width in targets) else 1
        for n in range(min(lanes, len(targets))):
            self._give(self._lanes, _relay, self._buffers, targets[n::lanes], ref, rows, tag, where, n == 0)

    def _give(self, crew: _Crew, fn: Callable[..., None], *args: Any) -> None:
        self._given += 1
        crew.give(fn, args)

    def ended(self, failure: BaseException | None) -> None:
        """Called by a lane after each job (with its exception, if it failed): wakes the main thread once
        what it waits for has ended, or at the first failure."""
        with self._progress:
            self._ended += 1
            if failure is not None:
                self._failed.append(failure)
            if self._ahead is not None and (self._failed or self._given - self._ended <= self._ahead):
                self._progress.notify()

    def pace(self) -> None:
        """Raise the first failure so far (the main thread stops early instead of converting the rest),
        and keep the main thread at most ``_AHEAD`` jobs ahead, so memory does not grow with the model;
        once that far, it waits until half of them have ended (one wake-up, not one per job)."""
        if self._failed:
            raise self._failed[0]
        if self._given - self._ended > _AHEAD:
            self._wait(_AHEAD // 2)

    def _wait(self, ahead: int) -> None:
        with self._progress:
            self._ahead = ahead
            try:
                while self._given - self._ended > ahead and not self._failed:
                    self._progress.wait()
            finally:
                self._ahead = None
        if self._failed:
            raise self._failed[0]

    def finish(self) -> None:
        """Wait for every copy and check; raise the first failure."""
        self._wait(0)

    def close(self) -> None:
        """Drop the jobs that have not started and wait for the rest (before the rank files are closed)."""
        for crew in self._crews:
            crew.stop()
        for crew in self._crews:
            crew.join()


class _Crew:
    """Threads taking jobs from one queue, each the next when it is free (``concurrent.futures`` would add ~7 ms
    of imports to every export and a future per job). After each job ``ended`` gets its exception or None;
    stopping drops the jobs not started."""

    def __init__(self, name: str, size: int, ended: Callable[[BaseException | None], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ended = ended
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, name=name, daemon=True) for _ in range(size)]
        for thread in self._threads:
            thread.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def give(self, fn: Callable[..., None], args: tuple) -> None:
        self._jobs.put((fn, args))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            failure = None
            try:
                if not self._stopping:
                    fn(*args)
            except BaseException as exc:  # noqa: BLE001 (handed to the main thread, which raises it)
                failure = exc
            self._ended(failure)

    def stop(self) -> None:
        self._stopping = True
        for _ in self._threads:
            self._jobs.put(None)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()


def _copy(writer: RankWriter, name: str, offset: int, block: np.ndarray, ref: TensorRef,
          span: tuple[int, int, int]) -> None:
    if not writer.copy(name, offset, *span):
        writer.write(name, offset, block)  # the kernel or file system cannot: through the process
        ref.file.release(span[1], span[1] + span[2])


def _check(block: np.ndarray, ref: TensorRef, span: tuple[int, int, int], tag: str, where: str) -> None:
    _refuse_nonfinite(block, block, ref, tag, where)
    ref.file.release(span[1], span[1] + span[2])  # the check mapped the pages; keep peak memory flat


class _Buffers(threading.local):
    """Each lane's own reading and gathering buffers (``RELAY_BYTES``, or one row where a row is longer)."""

    def __init__(self):
        self.read = self.gather = np.empty(0, np.uint8)

    def take(self, attr: str, size: int) -> np.ndarray:
        buffer = getattr(self, attr)
        if buffer.size < size:
            buffer = np.empty(max(size, RELAY_BYTES), np.uint8)
            setattr(self, attr, buffer)
        return buffer[:size]


def _relay(buffers: _Buffers, targets: Sequence[tuple[RankWriter, str, int, int, int]], ref: TensorRef,
           rows: Rows, tag: str, where: str, check: bool) -> None:
    fd = ref.file.fileno()
    step = max(1, RELAY_BYTES // rows.stride)
    for first in range(0, rows.count, step):
        count = min(step, rows.count - first)
        data = buffers.take("read", count * rows.stride)
        _read(fd, memoryview(data), rows.start + first * rows.stride, ref, where)
        if check:
            values = data.view(NUMPY_TYPES[tag])
            _refuse_nonfinite(values, values, ref, tag, where)
        table = data.reshape(count, rows.stride)
        for writer, name, offset, col, width in targets:
            if width == rows.stride:
                writer.write(name, offset + first * width, data)
                continue
            out = buffers.take("gather", count * width).reshape(count, width)
            np.copyto(out, table[:, col:col + width])
            writer.write(name, offset + first * width, out)


def _read(fd: int, into: memoryview, pos: int, ref: TensorRef, where: str) -> None:
    while into:
        done = os.preadv(fd, [into], pos)
        if done == 0:
            raise UsageError(f"{where}: {Path(ref.file.path).name} ended inside tensor {ref.name}; "
                             "was it changed during the export?")
        into, pos = into[done:], pos + done


def write_job(job: Job, writers: Mapping[int, RankWriter], tag: str, where: str, transfers: Transfers,
              scratch: Scratch | None = None) -> int:
    """Convert and write one tensor to every rank that holds it; returns the bytes written.

    Ranks holding identical copies (embeddings, norms, row-parallel biases) share one conversion,
    and the ranks' blocks are visited in lockstep, so the column slices that the ranks take of the
    same rows (row-parallel weights) go to ``transfers`` together. Unchanged blocks go to ``transfers``.
    """
    scratch = scratch or Scratch()
    groups: dict[tuple, list[int]] = {}
    for rank, planned in job.per_rank.items():
        groups.setdefault(_signature(planned), []).append(rank)
    streams = [(job.per_rank[ranks[0]], ranks, _chunks(job.per_rank[ranks[0]], tag)) for ranks in groups.values()]
    written = 0
    for step in itertools.zip_longest(*(stream for _, _, stream in streams)):
        sliced: dict[tuple, tuple[TensorRef, Rows, list]] = {}  # the ranks' column slices of the same rows
        for (planned, ranks, _), item in zip(streams, step):
            if item is None:
                continue
            offset, piece, block, rows = item
            columns = _column_slice(piece, block, tag)
            if columns is not None:
                source_rows, col, width = columns
                targets = sliced.setdefault((piece.ref.name, source_rows), (piece.ref, source_rows, []))[2]
                targets += [(writers[r], planned.name, offset, col, width) for r in ranks]
                written += block.size * block.itemsize * len(ranks)
                continue
            if block is None:
                out = np.zeros((rows, *planned.shape[1:]), dtype=NUMPY_TYPES[tag])
            else:
                out = convert(block, piece.ref.tag, tag, scratch)
            span = _unchanged_span(piece, block, out)
            if span is not None:
                transfers.copy([(writers[r], planned.name, offset) for r in ranks], block, piece.ref, span, tag, where)
            else:
                if block is not None:
                    _refuse_nonfinite(out, block, piece.ref, tag, where)
                for rank in ranks:
                    writers[rank].write(planned.name, offset, out)
            written += out.nbytes * len(ranks)
        for ref, source_rows, targets in sliced.values():
            transfers.relay(targets, ref, source_rows, tag, where)
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
        layouts: dict[int, list[Planned]] = {r: [] for r in range(tp * pp)}
        for job in jobs:
            for rank, planned in job.per_rank.items():
                layouts[rank].append(planned)
        writers = {r: RankWriter(out / f"rank{r}.safetensors", [(t.name, t.shape) for t in layouts[r]], tag,
                                 page_residue=copy_alignment(layouts[r], tag)) for r in layouts}
        transfers = Transfers(writers)
        collect = gc.isenabled()
        gc.disable()  # no cycles are made here; the collector's passes over the per-block objects cost ~5% (measured)
        try:
            total = 0
            scratch = Scratch()
            for job in jobs:
                transfers.pace()
                total += write_job(job, writers, tag, where, transfers, scratch)
            transfers.finish()  # raises the first failure (a NaN/Inf beside a copy); the caller discards the output
        finally:
            if collect:
                gc.enable()
            transfers.close()
            for w in writers.values():
                w.close()
    timed = ", ".join(f"{way} {rate / 2**30:.2f} GiB/s" for way, rate in transfers.rates.items())
    log(f"wrote {tp * pp} rank file(s), {total / 2**20:.1f} MiB of {dtype} weights"
        + (f"; unchanged rows went {transfers.way} at the end (timed {timed})" if timed else ""))
    return norm


def export(adapter: DecoderAdapter, source: Path, ctx, *, hf_config: Mapping[str, Any] | None = None,
           prefixes: Sequence[str] | None = None) -> Artifact:
    """The export stage: a TensorRT-LLM unified checkpoint in ``ctx.workdir/checkpoint``.

    ``hf_config`` and ``prefixes`` let composite families (a decoder inside a multimodal checkpoint)
    reuse the converter with the inner text config and the inner weight-name prefix.
    """
    from forge.hf import inspect_checkpoint

    from ..profiles import BUILD_FLAGS, parse_version

    spec = ctx.spec
    source = Path(source)
    checkpoint = inspect_checkpoint(source, allow_pickle=spec.allow_pickle,
                                    trust_remote_code=spec.trust_remote_code)
    config = dict(hf_config or checkpoint.config)
    out = ctx.workdir / "checkpoint"
    norm = convert_checkpoint(adapter, config, checkpoint.weight_files, out, dtype=spec.dtype, tp=spec.tp,
                              pp=spec.pp, weight_format=checkpoint.weight_format, prefixes=prefixes,
                              where=str(source), log=ctx.log, write=not ctx.dry_run,
                              uneven_pp=parse_version(spec.backend_version) >= BUILD_FLAGS["uneven_pp"])
    architecture = (config.get("architectures") or [""])[0]
    meta = checkpoint_meta(adapter, norm, architecture, spec.dtype, spec.tp, spec.pp, source)
    ctx.note("export", {"format": "tensorrt-llm unified checkpoint", "architecture": meta["architecture"],
                        "dtype": spec.dtype, "tp": spec.tp, "pp": spec.pp,
                        "tied_lm_head": bool(norm.get("tie_word_embeddings")),
                        "vocab_padded_to": meta["vocab_size_padded"]})
    if ctx.option("parity", False) and not ctx.dry_run:
        check_parity(adapter, source, out, spec.dtype, ctx)
    if ctx.target == "tensorrtllm" and not spec.quant:  # a quantized build checks the quantized checkpoint
        from .loadercheck import check_checkpoint

        check_checkpoint(ctx, out)
    return Artifact(ARTIFACT_KIND, out, meta)


