"""Load generation against a served decoder: workloads, open- and closed-loop runs, statistics.

Modelled on tensorrtllm_backend's ``benchmark_core_model.py``: ``token-norm-dist`` draws input and
output lengths from normal distributions and sends random token ids straight to the tensorrt_llm
model (no tokenizer in the way). Text models (the ensemble, a BLS, a hand-written text model) get
synthetic prompts of about the same number of words. Every request goes over gRPC streaming, which
serves decoupled and plain models alike and times the first token when ``stream`` is on.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import ForgeError, UsageError
from .client import GrpcSession, ModelInputs, text_of, text_request

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
          "near old stone bridges and river banks under grey autumn skies").split()


@dataclass
class Item:
    """One request of a workload."""

    output_len: int
    tokens: list[int] | None = None  # token mode
    text: str | None = None  # text mode


@dataclass
class Sample:
    """What one request measured."""

    sent: float  # scheduled send time (perf_counter)
    done: float = 0.0
    first: float | None = None  # first response carrying tokens (streaming)
    output_tokens: int = 0
    error: str | None = None


def _lengths(rng: np.random.Generator, n: int, mean: float, stdev: float, low: int, high: int | None) -> list[int]:
    values = rng.normal(mean, stdev, n) if stdev > 0 else np.full(n, mean)
    values = np.clip(np.rint(values), low, high if high else None)
    return [int(v) for v in values]


def token_norm_dist(n: int, *, input_mean: float, input_stdev: float = 0.0, output_mean: float,
                    output_stdev: float = 0.0, vocab: int = 1000, seed: int = 0,
                    text: bool = False, max_input: int | None = None) -> list[Item]:
    """``n`` requests whose input/output lengths are normal(mean, stdev), at least 1 token each."""
    if n < 1:
        raise UsageError("--num-requests must be at least 1")
    if input_mean < 1 or output_mean < 1:
        raise UsageError("--input-mean and --output-mean must be at least 1")
    rng = np.random.default_rng(seed)
    inputs = _lengths(rng, n, input_mean, input_stdev, 1, max_input)
    outputs = _lengths(rng, n, output_mean, output_stdev, 1, None)
    items = []
    for length, out in zip(inputs, outputs):
        if text:
            words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), length)]
            items.append(Item(out, text=" ".join(words)))
        else:
            items.append(Item(out, tokens=[int(t) for t in rng.integers(1, max(2, vocab), length)]))
    return items


def prompts(texts: list[str], n: int, output_len: int) -> list[Item]:
    """``n`` requests cycling through ``texts``."""
    if not texts:
        raise UsageError("no prompts given")
    return [Item(output_len, text=texts[i % len(texts)]) for i in range(n)]


class Target:
    """How items become tensors for one served model, and how its answers are counted."""

    def __init__(self, inputs: ModelInputs, *, stream: bool,
                 count_text: Callable[[str], int] | None = None, extra: dict[str, Any] | None = None):
        self.inputs = inputs
        self.stream = stream
        self.count_text = count_text or (lambda text: len(text.split()))
        self.extra = extra or {}
        self.token_mode = "input_ids" in inputs.inputs
        if not self.token_mode and "text_input" not in inputs.inputs:
            raise UsageError(f"model {inputs.name!r} takes neither input_ids nor text_input; "
                             "bench the tensorrt_llm model, the ensemble or a text model")
        if stream and not inputs.decoupled and self.token_mode:
            raise UsageError(f"--stream needs a decoupled model; {inputs.name!r} is not (rebuild with --decoupled)")

    def tensors(self, item: Item) -> dict[str, np.ndarray]:
        if self.token_mode:
            if item.tokens is None:
                raise UsageError(f"model {self.inputs.name!r} takes token ids; use the token-norm-dist workload")
            tensors = {"input_ids": self.inputs.array("input_ids", item.tokens),
                       "input_lengths": self.inputs.array("input_lengths", len(item.tokens)),
                       "request_output_len": self.inputs.array("request_output_len", item.output_len)}
            if "streaming" in self.inputs.inputs and (self.stream or self.inputs.decoupled):
                tensors["streaming"] = self.inputs.array("streaming", self.stream)
            for name, value in self.extra.items():
                tensors[name] = self.inputs.array(name, value)
            return tensors
        text = item.text if item.text is not None else " ".join(_WORDS[t % len(_WORDS)] for t in item.tokens)
        return text_request(self.inputs, text, item.output_len, stream=self.stream, **self.extra)

    def count(self, item: Item, outputs: dict[str, np.ndarray], streamed: bool) -> int:
        if self.token_mode:
            ids = outputs.get("output_ids")
            if ids is None:
                return 0
            if streamed:
                return int(ids.shape[-1])
            lengths = outputs.get("sequence_length")
            total = int(np.asarray(lengths).reshape(-1)[0]) if lengths is not None else int(ids.shape[-1])
            row = np.asarray(ids).reshape(-1)[:total].tolist()
            prompt = len(item.tokens or [])
            return total - prompt if prompt and row[:prompt] == item.tokens else total
        for name in ("text_output", "OUTPUT"):
            if name in outputs:
                return self.count_text(text_of(outputs[name]))
        return 0


def _one(session: GrpcSession, target: Target, item: Item, sample: Sample, timeout_s: float) -> None:
    try:
        tokens = 0
        for event in session.stream(target.inputs.name, target.tensors(item), stop_after_s=timeout_s):
            produced = target.count(item, event.outputs, streamed=target.stream) if event.outputs else 0
            if produced and target.stream and sample.first is None:
                sample.first = time.perf_counter()
            tokens = tokens + produced if target.stream else max(tokens, produced)
        sample.output_tokens = tokens
    except (ForgeError, TimeoutError) as exc:
        sample.error = str(exc)
    except Exception as exc:  # a broken connection counts as a failed request, not a crashed bench
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.done = time.perf_counter()


def run(url: str, target: Target, items: list[Item], *, concurrency: int | None = None,
        request_rate: float | None = None, max_workers: int = 64, timeout_s: float = 600.0,
        seed: int = 0) -> tuple[list[Sample], float]:
    """Send every item; closed loop with ``concurrency`` workers, or Poisson arrivals at ``request_rate``.

    Returns the samples and the wall time from the first send to the last answer.
    """
    if (concurrency is None) == (request_rate is None):
        raise UsageError("give exactly one of --concurrency and --request-rate")
    if concurrency is not None and concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if request_rate is not None and request_rate <= 0:
        raise UsageError("--request-rate must be positive")
    work: queue.Queue = queue.Queue()
    samples: list[Sample] = []
    workers = concurrency or min(max_workers, len(items))
    sessions = [GrpcSession(url) for _ in range(workers)]

    def worker(session: GrpcSession) -> None:
        while True:
            job = work.get()
            if job is None:
                return
            item, sample = job
            if request_rate is not None:  # wait for this request's arrival time
                delay = sample.sent - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            else:
                sample.sent = time.perf_counter()
            _one(session, target, item, sample, timeout_s)

    started = time.perf_counter()
    rng = random.Random(seed)
    at = started
    for item in items:
        if request_rate is not None:
            at += rng.expovariate(request_rate)
        sample = Sample(sent=at)
        samples.append(sample)
        work.put((item, sample))
    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in sessions]
    for _ in threads:
        work.put(None)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for session in sessions:
            session.close()
    end = max((s.done for s in samples), default=started)
    return samples, end - min((s.sent for s in samples), default=started)


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    array = np.array(values) * 1000.0
    return {"p50": round(float(np.percentile(array, 50)), 2), "p90": round(float(np.percentile(array, 90)), 2),
            "p99": round(float(np.percentile(array, 99)), 2), "mean": round(float(array.mean()), 2)}


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """req/s, tokens/s, latency and first-token percentiles (ms) of the successful requests."""
    ok = [s for s in samples if s.error is None]
    errors = [s.error for s in samples if s.error is not None]
    wall_s = max(wall_s, 1e-9)
    tokens = sum(s.output_tokens for s in ok)
    return {
        "requests": len(samples),
        "succeeded": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall_s, 3),
        "req_per_s": round(len(ok) / wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2),
        "output_tokens": tokens,
        "latency_ms": _percentiles([s.done - s.sent for s in ok]),
        "first_token_ms": _percentiles([s.first - s.sent for s in ok if s.first is not None]),
    }


def format_table(rows: list[dict[str, Any]], label: str = "run") -> str:
    """A plain-text table of summaries (one row each, ``label`` names the first column)."""
    head = [label, "req/s", "tokens/s", "p50 ms", "p99 ms", "TTFT p50", "TTFT p99", "errors"]
    lines = []
    for row in rows:
        lat, first = row.get("latency_ms") or {}, row.get("first_token_ms") or {}
        lines.append([str(row.get(label, "")), f"{row['req_per_s']:.2f}", f"{row['tokens_per_s']:.1f}",
                      _ms(lat.get("p50")), _ms(lat.get("p99")), _ms(first.get("p50")), _ms(first.get("p99")),
                      str(row["errors"])])
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), *(fmt.format(*r) for r in lines)])


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"
