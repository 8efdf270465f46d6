"""Load generation against served decoders: workloads, arrivals, the run, its statistics and its table.

Modelled on tensorrtllm_backend's ``benchmark_core_model.py``. Workloads: ``token-norm-dist`` draws
input and output lengths from normal distributions (random token ids for the tensorrt_llm model,
prompts of that many tokens for text models), ``dataset`` reads the seed's JSON file (a list of
``{"input", "instruction", "output"}`` objects: the prompt is ``input + " " + instruction``, the
output length ``words(output) × op_tokens_per_word``), ``prompts`` cycles through given texts.
Arrivals are a closed loop (N requests in flight), Poisson or constant at a request rate. Requests
go over gRPC (bidirectional stream: decoupled and plain models alike) or HTTP (generate endpoints).

Generated tokens of text models are counted with the model's tokenizer after the run, so the
measuring threads only send and time. Several runs side by side (ratios, a table, a plot): :mod:`.comparison`.
"""

from __future__ import annotations

import json
import math
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ForgeError, UsageError
from ..clients.inference import GrpcSession, ModelInputs, generate_payload, is_text_generator, text_of
from ..clients.triton_http import HttpSession

WORKLOADS = ("token-norm-dist", "dataset", "prompts")
ARRIVALS = ("closed", "poisson", "constant")
DATASET_FORMAT = 'a JSON list of {"input", "instruction", "output"} objects (tensorrtllm_backend\'s dataset format)'

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
          "near old stone bridges and river banks under grey autumn skies").split()


@dataclass
class Item:
    """One request of a workload."""

    output_len: int
    tokens: list[int] | None = None  # token mode
    text: str | None = None  # text mode
    image: bytes | None = None  # multimodal ensembles: the request's encoded image


@dataclass
class Sample:
    """What one request measured."""

    sent: float  # scheduled send time (perf_counter)
    done: float = 0.0
    first: float | None = None  # first response carrying output (streaming)
    last: float | None = None  # last response carrying output (streaming)
    output_tokens: int | None = 0  # None: not counted (an OpenAI server without usage, no tokenizer)
    output_text: str | None = None  # text models: counted with the tokenizer after the run
    error: str | None = None


# -- workloads -----------------------------------------------------------------------------------

def _lengths(rng: np.random.Generator, n: int, mean: float, stdev: float, low: int, high: int | None) -> list[int]:
    values = rng.normal(mean, stdev, n) if stdev > 0 else np.full(n, mean)
    values = np.clip(np.rint(values), low, high if high else None)
    return [int(v) for v in values]


def token_norm_dist(n: int, *, input_mean: float, input_stdev: float = 0.0, output_mean: float,
                    output_stdev: float = 0.0, vocab: int = 1000, seed: int = 0, text: bool = False,
                    max_input: int | None = None, tokenizer: Any = None) -> list[Item]:
    """``n`` requests whose input/output lengths are normal(mean, stdev), at least 1 token each.

    Lengths above ``max_input`` are clipped; a mean above it is refused. Text prompts are words cut
    to the drawn number of tokens of ``tokenizer`` (without one, that many words).
    """
    if n < 1:
        raise UsageError("--num-requests must be at least 1")
    if input_mean < 1 or output_mean < 1:
        raise UsageError("--input-mean and --output-mean must be at least 1")
    if max_input and input_mean > max_input:
        raise UsageError(f"--input-mean {input_mean:g} is longer than the model's max input ({max_input} tokens)",
                         hint=f"use --input-mean {max_input} or less, or rebuild with a larger --max-input-len")
    rng = np.random.default_rng(seed)
    inputs = _lengths(rng, n, input_mean, input_stdev, 1, max_input)
    outputs = _lengths(rng, n, output_mean, output_stdev, 1, None)
    items = []
    for length, out in zip(inputs, outputs):
        if text:
            words = " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), length))
            if tokenizer is not None:
                words = _cut(tokenizer, words, length, max_input)
            items.append(Item(out, text=words))
        else:
            items.append(Item(out, tokens=[int(t) for t in rng.integers(1, max(2, vocab), length)]))
    return items


def _cut(tokenizer: Any, words: str, length: int, max_input: int | None) -> str:
    """``words`` cut to ``length`` tokens, and to ``max_input`` once the tokenizer adds its special tokens."""
    ids = tokenizer.encode(words, add_special_tokens=False)[:length]
    text = tokenizer.decode(ids).strip()
    while max_input and len(ids) > 1 and len(tokenizer.encode(text)) > max_input:
        ids = ids[:-1]
        text = tokenizer.decode(ids).strip()
    return text


def read_dataset(path: Path, *, num_requests: int | None = None, op_tokens_per_word: float = 1.3) -> list[Item]:
    """The seed's dataset file as requests: prompt ``input + " " + instruction``, output ``words × ratio``."""
    where = f"dataset {path}"
    if not Path(path).is_file():
        raise UsageError(f"{where} does not exist")
    try:
        data = json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{where} is not JSON ({exc}); expected {DATASET_FORMAT}") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"{where} is not in the seed's format: expected {DATASET_FORMAT}")
    if op_tokens_per_word <= 0:
        raise UsageError("--op-tokens-per-word must be positive")
    items = []
    for number, entry in enumerate(data, 1):
        missing = [k for k in ("input", "instruction", "output")
                   if not isinstance(entry, dict) or not isinstance(entry.get(k), str)]
        if missing:
            raise UsageError(f"{where} is not in the seed's format: entry {number} has no text {missing[0]!r}; "
                             f"expected {DATASET_FORMAT}")
        prompt = f"{entry['input']} {entry['instruction']}"
        if not prompt.strip():
            raise UsageError(f"{where}: entry {number} has an empty input and instruction")
        items.append(Item(max(1, int(len(entry["output"].split(" ")) * op_tokens_per_word)), text=prompt))
    if num_requests is not None:
        if num_requests < 1:
            raise UsageError("--num-requests must be at least 1")
        items = items[:num_requests]
    return items


def attach_images(items: list[Item], images: list[bytes]) -> None:
    """Give the requests the images in turn (a multimodal workload: the same prompts, each with an image)."""
    for index, item in enumerate(items):
        item.image = images[index % len(images)]


def prompts(texts: list[str], n: int, output_len: int) -> list[Item]:
    """``n`` requests cycling through ``texts``."""
    if not texts:
        raise UsageError("no prompts given (--prompt TEXT or --prompts-file FILE)")
    if n < 1 or output_len < 1:
        raise UsageError("--num-requests and --output-len must be at least 1")
    return [Item(output_len, text=texts[i % len(texts)]) for i in range(n)]


# -- one served model ------------------------------------------------------------------------------

class Target:
    """How items become requests for one served model, and how its answers are counted.

    ``count_text`` counts the tokens of generated text (a tokenizer; words without one); ``encode``
    turns text items into token ids for token-id models; ``echoes`` lists the forms in which a model
    that returns the prompt with its answer may spell it (decoded without special tokens, say).
    """

    def __init__(self, inputs: ModelInputs, *, stream: bool, count_text: Callable[[str], int] | None = None,
                 extra: dict[str, Any] | None = None, encode: Callable[[str], list[int]] | None = None,
                 echoes: Callable[[str], list[str]] | None = None):
        self.inputs = inputs
        self.stream = stream
        self.count_text = count_text or (lambda text: len(text.split()))
        self.encode = encode
        self.echoes = echoes
        self._encoded: dict[int, list[int]] = {}  # items are shared between targets; their ids are not
        self.extra = extra or {}
        self.lora = None  # serving.lora.LoraRequests when requests mix LoRA adapters
        self._adapters: dict[int, Any] = {}
        self.placeholder = "<image>"  # set from --image-placeholder when images are sent
        self.token_mode = "input_ids" in inputs.inputs
        if not self.token_mode and not is_text_generator(inputs):
            raise UsageError(f"model {inputs.name!r} is not a text-generation model (it takes neither input_ids "
                             "nor text_input and max_tokens)",
                             hint="bench the tensorrt_llm model, the ensemble or a text model")
        if stream and not inputs.decoupled and self.token_mode:
            raise UsageError(f"--stream needs a decoupled model; {inputs.name!r} is not (rebuild with --decoupled)")

    def payload(self, item: Item) -> dict[str, Any]:
        """The request's inputs by name (python values; sessions type them from the model config)."""
        if self.token_mode:
            tokens = self.prompt_ids(item)
            payload: dict[str, Any] = {"input_ids": tokens, "input_lengths": len(tokens),
                                       "request_output_len": item.output_len}
            if "streaming" in self.inputs.inputs and (self.stream or self.inputs.decoupled):
                payload["streaming"] = self.stream
            payload.update(self.extra)
            return payload
        text = item.text if item.text is not None else " ".join(_WORDS[t % len(_WORDS)] for t in item.tokens)
        if item.image is not None and self.placeholder not in text:
            text = f"{self.placeholder}\n{text}"  # the image goes where its placeholder is
        return generate_payload(self.inputs, text, item.output_len, stream=self.stream, image=item.image,
                                **self.extra)

    def use_lora(self, adapters: list, items: list[Item]) -> None:
        """Send the items with these adapters in turn (None: the base model), the backend's cache protocol."""
        from ..clients.lora_requests import LoraRequests

        self.lora = LoraRequests(self.inputs)
        self._adapters = {id(item): adapters[n % len(adapters)] for n, item in enumerate(items)}

    def adapter(self, item: Item):
        return self._adapters.get(id(item))

    def prompt_ids(self, item: Item) -> list[int]:
        """The item's token ids: its own, or its text encoded with this target's tokenizer (once)."""
        if item.tokens is not None:
            return item.tokens
        if id(item) not in self._encoded:
            if self.encode is None:
                raise UsageError(f"model {self.inputs.name!r} takes token ids and no tokenizer was found "
                                 "to encode the prompts", hint="pass --tokenizer DIR")
            self._encoded[id(item)] = self.encode(item.text or "")
        return self._encoded[id(item)]

    def tensors(self, item: Item) -> dict[str, np.ndarray]:
        """The request as typed arrays (gRPC)."""
        return {name: self.inputs.array(name, value) for name, value in self.payload(item).items()}

    def count(self, item: Item, outputs: dict[str, Any], streamed: bool) -> int:
        """Generated tokens in one response."""
        if self.token_mode:
            ids = outputs.get("output_ids")
            if ids is None:
                return 0
            ids = np.asarray(ids)
            if streamed:
                return int(ids.shape[-1])
            lengths = outputs.get("sequence_length")
            total = int(np.asarray(lengths).reshape(-1)[0]) if lengths is not None else int(ids.shape[-1])
            row = ids.reshape(-1)[:total].tolist()
            prompt = self.prompt_ids(item) if item.tokens is not None or self.encode else []
            return total - len(prompt) if prompt and row[: len(prompt)] == prompt else total
        return self.count_text(self.generated(item, self.text(outputs)))

    @staticmethod
    def text(outputs: dict[str, Any]) -> str:
        for name in ("text_output", "OUTPUT"):
            if name in outputs:
                return text_of(outputs[name])
        return ""

    def generated(self, item: Item, text: str) -> str:
        """The generated part of ``text``: models that echo the prompt (exclude_input_in_output off) lose it."""
        prompt = item.text or ""
        if not prompt:
            return text
        forms = [prompt] + (self.echoes(prompt) if self.echoes else [])
        for form in sorted({f for f in forms if f}, key=len, reverse=True):
            for candidate, body in ((form, text), (form.lstrip(), text.lstrip())):
                if candidate and body.startswith(candidate):
                    return body[len(candidate):]
        return text


def _one(session, target: Target, item: Item, sample: Sample, timeout_s: float) -> None:
    try:
        if target.lora is None:
            _answer(session.send(target.inputs, target.payload(item), stream=target.stream, stop_after_s=timeout_s),
                    target, item, sample)
        else:  # LoRA arrays are sent as tensors (gRPC)
            target.lora.call(target.adapter(item), lambda extra: _answer(
                session.stream(target.inputs.name, {**target.tensors(item), **extra}, stop_after_s=timeout_s),
                target, item, sample))
    except (ForgeError, TimeoutError) as exc:
        sample.error = str(exc)
    except Exception as exc:  # a broken connection counts as a failed request, not a crashed bench
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.done = time.perf_counter()


def _answer(events, target: Target, item: Item, sample: Sample) -> None:
    """Count one request's responses into ``sample``."""
    tokens, pieces = 0, []
    for event in events:
        if not event.outputs:
            continue
        if target.token_mode:
            produced = target.count(item, event.outputs, streamed=target.stream)
            tokens = tokens + produced if target.stream else max(tokens, produced)
            carried = produced > 0
        else:
            piece = target.text(event.outputs)
            pieces.append(piece)
            carried = bool(piece)
        if carried and target.stream:
            at = event.at or time.perf_counter()
            sample.first = at if sample.first is None else sample.first
            sample.last = at
    sample.output_tokens = tokens
    if not target.token_mode:
        sample.output_text = "".join(pieces)


def arrival_times(n: int, start: float, *, request_rate: float, arrivals: str = "poisson",
                  seed: int = 0) -> list[float]:
    """Send times of ``n`` open-loop requests: Poisson (exponential gaps) or constant gaps of 1/rate."""
    if arrivals == "constant":
        return [start + i / request_rate for i in range(n)]
    rng = random.Random(seed)
    times, at = [], start
    for _ in range(n):
        at += rng.expovariate(request_rate)
        times.append(at)
    return times


def open_session(url: str, protocol: str = "grpc") -> GrpcSession | HttpSession:
    """A session to the server at ``url`` over ``protocol`` (grpc or http): both send a request the same way."""
    return HttpSession(url) if protocol == "http" else GrpcSession(url)


def run(url: str, target: Target, items: list[Item], *, concurrency: int | None = None,
        request_rate: float | None = None, arrivals: str = "poisson", protocol: str = "grpc",
        max_workers: int = 64, timeout_s: float = 600.0, seed: int = 0) -> tuple[list[Sample], float]:
    """Send every item; closed loop with ``concurrency`` workers, or open loop at ``request_rate``.

    Open-loop latency runs from each request's scheduled arrival, so a server that falls behind
    shows it. Returns the samples and the wall time from the first send to the last answer.
    """
    if (concurrency is None) == (request_rate is None):
        raise UsageError("give exactly one of --concurrency and --request-rate")
    if concurrency is not None and concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if request_rate is not None and request_rate <= 0:
        raise UsageError("--request-rate must be positive")
    if arrivals not in ARRIVALS:
        raise UsageError(f"unknown arrivals {arrivals!r}; choose from {', '.join(ARRIVALS)}")
    work: queue.Queue = queue.Queue()
    workers = concurrency or min(max_workers, len(items))
    sessions = [open_session(url, protocol) for _ in range(workers)]

    def worker(session) -> None:
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
    if request_rate is not None:
        times = arrival_times(len(items), started, request_rate=request_rate, arrivals=arrivals, seed=seed)
    else:
        times = [started] * len(items)
    samples = [Sample(sent=at) for at in times]
    for item, sample in zip(items, samples):
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
    for item, sample in zip(items, samples):  # counted now, so the sending threads only send and time
        if sample.output_text is not None and sample.error is None:
            sample.output_text = target.generated(item, sample.output_text)
            sample.output_tokens = target.count_text(sample.output_text)
    end = max((s.done for s in samples), default=started)
    return samples, end - min((s.sent for s in samples), default=started)


# -- statistics ------------------------------------------------------------------------------------

def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    array = np.array(values) * 1000.0
    return {"p50": round(float(np.percentile(array, 50)), 2), "p90": round(float(np.percentile(array, 90)), 2),
            "p99": round(float(np.percentile(array, 99)), 2), "mean": round(float(array.mean()), 2)}


def summarize(samples: list[Sample], wall_s: float) -> dict[str, Any]:
    """req/s, generated tokens/s, latency, first-token and inter-token percentiles (ms) of successful requests.

    Inter-token latency is per request: (last output − first output) / (tokens − 1), streamed requests only.
    """
    ok = [s for s in samples if s.error is None]
    errors = [s.error for s in samples if s.error is not None]
    wall_s = max(wall_s, 1e-9)
    counted = [s.output_tokens for s in ok]
    tokens = None if None in counted else sum(counted)  # an uncounted request leaves the total unmeasured, not 0
    gaps = [(s.last - s.first) / (s.output_tokens - 1) for s in ok
            if s.first is not None and s.last is not None and (s.output_tokens or 0) > 1]
    return {
        "requests": len(samples),
        "succeeded": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": round(wall_s, 3),
        "req_per_s": round(len(ok) / wall_s, 3),
        "tokens_per_s": None if tokens is None else round(tokens / wall_s, 2),
        "output_tokens": tokens,
        "latency_ms": _percentiles([s.done - s.sent for s in ok]),
        "first_token_ms": _percentiles([s.first - s.sent for s in ok if s.first is not None]),
        "inter_token_ms": _percentiles(gaps),
    }


# -- one run's table ---------------------------------------------------------------------------------

def table_text(head: list[str], lines: list[list[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the numbers right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head), *(fmt.format(*r) for r in lines)])


def format_table(rows: list[dict[str, Any]], label: str = "run") -> str:
    """A plain-text table of summaries (one row each, ``label`` names the first column)."""
    head = [label, "req/s", "tokens/s", "p50 ms", "p90 ms", "p99 ms", "TTFT p50", "TTFT p99", "errors"]
    lines = []
    for row in rows:
        lat, first = row.get("latency_ms") or {}, row.get("first_token_ms") or {}
        lines.append([str(row.get(label, "")), f"{row['req_per_s']:.2f}", rate_text(row["tokens_per_s"]),
                      ms_text(lat.get("p50")), ms_text(lat.get("p90")), ms_text(lat.get("p99")),
                      ms_text(first.get("p50")), ms_text(first.get("p99")), str(row["errors"])])
    return table_text(head, lines)


def rate_text(value: float | None) -> str:
    """A rate as a table cell ("-": not measured)."""
    return "-" if value is None else f"{value:.1f}"


def ms_text(value: float | None) -> str:
    """Milliseconds as a table cell ("-": not measured)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"
