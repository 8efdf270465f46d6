"""Build the output tensors of the tensorrt_llm model interface from generated sequences.

Shapes follow tensorrtllm_backend: ``output_ids`` ``[batch, beam, tokens]``, ``sequence_length``
``[batch, beam]``, ``cum_log_probs`` ``[batch, beam]``, ``output_log_probs`` ``[batch, beam, tokens]``,
``context_logits`` ``[batch, prompt, vocab]``, ``generation_logits`` ``[batch, beam, tokens, vocab]``,
``batch_index`` ``[batch, 1]``. Which outputs a response carries follows the backend version the repository
was built for (``carried``): up to v0.13.0 every configured output, log probs and logits a request did not
ask for as zeros of the minimal shape; from v0.14.0 (the executor-based backend) only what the request asked
for (``return_log_probs``, ``return_*_logits``, ``return_perf_metrics``, ``return_num_*_tokens``) and
``batch_index`` only for a request of several rows. Outputs this runtime cannot compute (KV-cache block
statistics, draft-token acceptance) are left out of every response, never zero-filled as if measured:
a client that asks for them gets no such tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np


class Progress(NamedTuple):
    """A sequence's running figures when the engine reported an update."""

    cum_logprob: float
    first_token_ns: int
    last_token_ns: int
    output_tokens: int


class Queued:
    """One item of a sender thread's queue: a sequence's update and its progress as of that update. Later
    updates may join it (under ``lock``) until a sender takes it; ``on_take(seq)`` runs (under ``lock``) when one
    does."""

    __slots__ = ("owner", "seq", "update", "progress", "lock", "on_take", "taken")

    def __init__(self, owner: Any, seq: Any, update: Any, progress: Progress, lock, on_take: Callable[[Any], None]):
        self.owner, self.seq, self.update, self.progress, self.lock = owner, seq, update, progress, lock
        self.on_take, self.taken = on_take, False

    def take(self) -> tuple[Any, Progress] | None:
        """Sender thread: the update (with every one that joined it) and the latest progress; None once taken."""
        with self.lock:
            if self.taken:
                return None
            self.taken = True
            self.on_take(self.seq)
            return self.update, self.progress


@dataclass(frozen=True)
class OutputSpec:
    """One configured output: its numpy dtype and the number of dims after the batch dim."""

    dtype: np.dtype
    rank: int


@dataclass
class RowResult:
    """What one response carries for one batch row."""

    ids: list[int]  # the tokens of output_ids (prompt + generated, generated only, or a stream chunk)
    logprobs: list[float] = field(default_factory=list)  # of the generated tokens in ``ids``
    cum_logprob: float = 0.0
    want_logprobs: bool = False
    context_logits: np.ndarray | None = None
    generation_logits: list[np.ndarray] = field(default_factory=list)
    batch_index: int = 0
    arrival_ns: int = 0
    scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reason: str | None = None  # why the sequence ended (the engine's reason), on its last response
    top: list = field(default_factory=list)  # toplogprobs.Position of each generated token in ``ids`` (if asked)
    prompt_top: list | None = None  # toplogprobs.Position of each prompt token, on the first response (if asked)


def _padded(rows: list[list], fill, dtype) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), 1, width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, 0, : len(r)] = r
    return out


def _column(results: list[RowResult], value, dtype) -> np.ndarray:
    return np.array([[value(r)] for r in results], dtype=dtype)


def _log_probs(results: list[RowResult]) -> np.ndarray:
    if any(r.want_logprobs for r in results):
        return _padded([r.logprobs if r.want_logprobs else [] for r in results], 0.0, np.float32)
    return np.zeros((len(results), 1, 1), np.float32)


def _context_logits(results: list[RowResult]) -> np.ndarray:
    with_context = [r.context_logits for r in results if r.context_logits is not None]
    if not with_context:
        return np.zeros((len(results), 1, 1), np.float32)
    length = max(c.shape[0] for c in with_context)
    context = np.zeros((len(results), length, with_context[0].shape[1]), np.float32)
    for i, r in enumerate(results):
        if r.context_logits is not None:
            context[i, : r.context_logits.shape[0]] = r.context_logits
    return context


def _generation_logits(results: list[RowResult]) -> np.ndarray:
    with_generation = [r.generation_logits for r in results if r.generation_logits]
    if not with_generation:
        return np.zeros((len(results), 1, 1, 1), np.float32)
    steps = max(len(g) for g in with_generation)
    generation = np.zeros((len(results), 1, steps, with_generation[0][0].shape[-1]), np.float32)
    for i, r in enumerate(results):
        for j, step in enumerate(r.generation_logits):
            generation[i, 0, j] = step
    return generation


#: How each output is computed from the rows' results (only those a response carries are computed: a streamed
#: response is built once per token)
OUTPUTS = {
    "output_ids": lambda results, pad_id: _padded([r.ids for r in results], pad_id, np.int64),
    "sequence_length": lambda results, _pad: _column(results, lambda r: len(r.ids), np.int64),
    "cum_log_probs": lambda results, _pad: _column(
        results, lambda r: r.cum_logprob if r.want_logprobs else 0.0, np.float32),
    "batch_index": lambda results, _pad: _column(results, lambda r: r.batch_index, np.int64),
    "arrival_time_ns": lambda results, _pad: _column(results, lambda r: r.arrival_ns, np.int64),
    "first_token_time_ns": lambda results, _pad: _column(results, lambda r: r.first_token_ns, np.int64),
    "first_scheduled_time_ns": lambda results, _pad: _column(results, lambda r: r.scheduled_ns, np.int64),
    "last_token_time_ns": lambda results, _pad: _column(results, lambda r: r.last_token_ns, np.int64),
    "num_input_tokens": lambda results, _pad: _column(results, lambda r: r.input_tokens, np.int64),
    "num_output_tokens": lambda results, _pad: _column(results, lambda r: r.output_tokens, np.int64),
    "sequence_index": lambda results, _pad: np.zeros((len(results), 1), dtype=np.int64),
    "output_log_probs": lambda results, _pad: _log_probs(results),
    "context_logits": lambda results, _pad: _context_logits(results),
    "generation_logits": lambda results, _pad: _generation_logits(results),
}


#: The outputs the executor-based backend (v0.14.0 on) sends only to a request that sets the flag
ASKED_BY = {"cum_log_probs": "return_log_probs", "output_log_probs": "return_log_probs",
            "context_logits": "return_context_logits", "generation_logits": "return_generation_logits",
            "arrival_time_ns": "return_perf_metrics", "first_scheduled_time_ns": "return_perf_metrics",
            "first_token_time_ns": "return_perf_metrics", "last_token_time_ns": "return_perf_metrics",
            "num_input_tokens": "return_num_input_tokens", "num_output_tokens": "return_num_output_tokens"}


def carried(rows: list, specs: Mapping[str, OutputSpec], wanted: set[str] | None, asked_only: bool) -> set[str]:
    """The outputs every response to a request of ``rows`` (its ``GenerationRequest``s) carries: the configured
    ones the client wants (``wanted``; None: all), and with ``asked_only`` (a v0.14.0+ interface) only those its
    flags ask for, ``batch_index`` only for several rows and ``sequence_index`` never (one sequence per row)."""
    names = {name for name in specs if name in OUTPUTS and (wanted is None or name in wanted)}
    if not asked_only:
        return names
    return {name for name in names
            if (name not in ASKED_BY or any(getattr(row, ASKED_BY[name]) for row in rows))
            and (name != "batch_index" or len(rows) > 1) and name != "sequence_index"}


def assemble(results: list[RowResult], specs: Mapping[str, OutputSpec], pad_id: int = 0,
             wanted: set[str] | None = None) -> dict[str, np.ndarray]:
    """The configured outputs in ``wanted`` (None: all) for ``results`` (one entry per row), cast to their dtypes;
    configured outputs this runtime cannot compute are left out."""
    out: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        make = OUTPUTS.get(name)
        if make is not None and (wanted is None or name in wanted):
            out[name] = np.ascontiguousarray(make(results, pad_id).astype(spec.dtype, copy=False))
    return out
