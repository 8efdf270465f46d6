"""The copy engine of a checkpoint export: tensors streamed, in parallel, into pre-sized rank files.

:func:`write_job` converts one tensor's blocks (:mod:`.tensorio`) and writes them where the plan
(:mod:`.sharding`) puts them in each rank file (:mod:`.rankfile`); blocks whose bytes do not change go
to :class:`Transfers`, which copies them file to file in the kernel or relays them on lanes (threads),
checked for NaN/Inf on the way, while the converting thread goes on. Peak memory stays at a few chunks
whatever the model size.
"""

from __future__ import annotations

import itertools
import math
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from forge.errors import UsageError

from .rankfile import RankWriter
from .sharding import Job, Piece, Planned
from .tensorio import CHUNK_BYTES, NUMPY_TYPES, Scratch, TensorRef, convert, nonfinite


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
    0.71× ``cp`` where the kernel way made 1.63×; in its fast phases relaying was erratic): an export times both ways as it goes (``_time``) and relays where that was much faster.
    Column slices (row-parallel weights at tp > 1) are always relayed, all ranks' slices in one job, so the
    rows are read once. The main thread meanwhile converts and writes the blocks whose bytes change.
    ``finish`` waits for all, or raises the first failure; ``close`` drops what has not started and waits for
    the rest (before the rank files are closed). Every design tried, with its numbers:
    docs/performance/conversion.md.
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
