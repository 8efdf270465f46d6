"""Build the output tensors of the tensorrt_llm model interface from generated sequences.

Shapes follow tensorrtllm_backend: ``output_ids`` ``[batch, beam, tokens]``, ``sequence_length``
``[batch, beam]``, ``cum_log_probs`` ``[batch, beam]``, ``output_log_probs`` ``[batch, beam, tokens]``,
``context_logits`` ``[batch, prompt, vocab]``, ``generation_logits`` ``[batch, beam, tokens, vocab]``,
``batch_index`` ``[batch, 1]``. Log probs and logits a request did not ask for are zeros of the
minimal shape, as the backend returns them. Outputs this runtime cannot compute (KV-cache block
statistics, draft-token acceptance) are left out of every response, never zero-filled as if measured:
a client that asks for them gets no such tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np


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


def _padded(rows: list[list], fill, dtype) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), 1, width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, 0, : len(r)] = r
    return out


def assemble(results: list[RowResult], specs: Mapping[str, OutputSpec], pad_id: int = 0,
             wanted: set[str] | None = None) -> dict[str, np.ndarray]:
    """The configured outputs in ``wanted`` (None: all) for ``results`` (one entry per row), cast to their dtypes."""
    if wanted is not None:
        specs = {name: spec for name, spec in specs.items() if name in wanted}
    batch = len(results)
    tensors: dict[str, np.ndarray] = {
        "output_ids": _padded([r.ids for r in results], pad_id, np.int64),
        "sequence_length": np.array([[len(r.ids)] for r in results], dtype=np.int64),
        "cum_log_probs": np.array([[r.cum_logprob if r.want_logprobs else 0.0] for r in results], np.float32),
        "batch_index": np.array([[r.batch_index] for r in results], dtype=np.int64),
        "arrival_time_ns": np.array([[r.arrival_ns] for r in results], dtype=np.int64),
        "first_token_time_ns": np.array([[r.first_token_ns] for r in results], dtype=np.int64),
        "first_scheduled_time_ns": np.array([[r.scheduled_ns] for r in results], dtype=np.int64),
        "last_token_time_ns": np.array([[r.last_token_ns] for r in results], dtype=np.int64),
        "num_input_tokens": np.array([[r.input_tokens] for r in results], dtype=np.int64),
        "num_output_tokens": np.array([[r.output_tokens] for r in results], dtype=np.int64),
        "sequence_index": np.zeros((batch, 1), dtype=np.int64),
    }
    if any(r.want_logprobs for r in results):
        tensors["output_log_probs"] = _padded([r.logprobs if r.want_logprobs else [] for r in results],
                                              0.0, np.float32)
    else:
        tensors["output_log_probs"] = np.zeros((batch, 1, 1), np.float32)
    with_context = [r.context_logits for r in results if r.context_logits is not None]
    if with_context:
        length = max(c.shape[0] for c in with_context)
        vocab = with_context[0].shape[1]
        context = np.zeros((batch, length, vocab), np.float32)
        for i, r in enumerate(results):
            if r.context_logits is not None:
                context[i, : r.context_logits.shape[0]] = r.context_logits
        tensors["context_logits"] = context
    else:
        tensors["context_logits"] = np.zeros((batch, 1, 1), np.float32)
    with_generation = [r.generation_logits for r in results if r.generation_logits]
    if with_generation:
        steps = max(len(g) for g in with_generation)
        vocab = with_generation[0][0].shape[-1]
        generation = np.zeros((batch, 1, steps, vocab), np.float32)
        for i, r in enumerate(results):
            for j, step in enumerate(r.generation_logits):
                generation[i, 0, j] = step
        tensors["generation_logits"] = generation
    else:
        tensors["generation_logits"] = np.zeros((batch, 1, 1, 1), np.float32)

    out: dict[str, np.ndarray] = {}
    for name, spec in specs.items():
        value = tensors.get(name)
        if value is not None:
            out[name] = np.ascontiguousarray(value.astype(spec.dtype, copy=False))
    return out
