"""Load for ``forge bench --api openai``: any OpenAI-compatible server, asked with the ``openai`` client.

The server's ``GET /v1/models`` is checked before any load (reachable, the model listed); requests go
to ``/v1/chat/completions`` (the prompt as one user message) or ``/v1/completions`` (the prompt as
is) from one asyncio loop: a closed loop of N in flight or open-loop arrivals, as :func:`bench.run`.
Streamed answers (``stream_options.include_usage``) time their first and last text chunks. Generated
tokens are the server's ``usage.completion_tokens``; without usage, the text counted with
``--tokenizer``; without either, not counted (``None``, never 0).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UsageError
from .runner import Item, Sample, arrival_times, summarize

ENDPOINTS = ("chat", "completions")


@dataclass
class OpenAITarget:
    """One OpenAI-compatible server and the model, endpoint and mode its requests use."""

    url: str
    model: str
    endpoint: str = "chat"
    api_key: str = "none"
    stream: bool = False
    count_text: Callable[[str], int] | None = None  # when the server reports no usage
    chunked: int = 0  # streamed answers that came in more than one text chunk

    @property
    def label(self) -> str:
        return f"{self.model}@{self.url}"


def api_key(given: str | None) -> str:
    """--api-key, else $OPENAI_API_KEY, else a placeholder (servers without a key ignore it)."""
    return given or os.environ.get("OPENAI_API_KEY") or "none"


def check_url(url: str | None) -> str:
    if not url:
        raise UsageError("--api openai needs the server's base URL", hint="pass --url http://HOST:PORT/v1")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url} is not an http(s) URL", hint="pass --url http://HOST:PORT/v1")
    return url.rstrip("/")


def served_models(url: str, key: str, timeout_s: float = 10.0) -> list[str]:
    """The model ids ``GET {url}/models`` lists; an unreachable or non-OpenAI server is bad input (one line)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout_s)
    try:
        return [model.id for model in client.models.list()]
    except openai.APIConnectionError as exc:
        raise UsageError(f"cannot reach an OpenAI-compatible server at {url} ({_cause(exc)})",
                         hint="check --url (the base URL, ending /v1) and that the server runs") from None
    except openai.AuthenticationError:
        raise UsageError(f"{url}/models refused the API key (401)",
                         hint="pass --api-key KEY or set OPENAI_API_KEY") from None
    except openai.APIStatusError as exc:
        raise UsageError(f"{url}/models answered {exc.status_code}, so {url} is not an OpenAI API base URL",
                         hint="pass the base URL, ending /v1 (e.g. http://127.0.0.1:9000/v1)") from None
    except openai.APIError as exc:  # a body that is no model list
        raise UsageError(f"{url}/models did not answer a model list ({exc.message})",
                         hint="pass the base URL, ending /v1") from None
    finally:
        client.close()


def _cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc) or type(exc).__name__


def resolve(url: str | None, model: str | None, *, endpoint: str | None, key: str | None,
            stream: bool) -> OpenAITarget:
    """The target, checked against the server's model list (a model it does not list is refused, naming those it has)."""
    url = check_url(url)
    key = api_key(key)
    ids = served_models(url, key)
    if model is None:
        if len(ids) != 1:
            raise UsageError(f"{url} serves {len(ids)} models ({', '.join(ids) or 'none'}); pick one with --model ID")
        model = ids[0]
    elif model not in ids:
        raise UsageError(f"{url} has no model {model!r} (it has: {', '.join(ids) or 'none'})",
                         hint="pass one of them to --model")
    return OpenAITarget(url, model, endpoint or "chat", key, stream)


# -- one load point ----------------------------------------------------------------------------------

async def _one(client, target: OpenAITarget, item: Item, sample: Sample) -> None:
    import openai

    chat = target.endpoint == "chat"
    if chat:
        create, prompt = client.chat.completions.create, {"messages": [{"role": "user", "content": item.text}]}
    else:
        create, prompt = client.completions.create, {"prompt": item.text}
    pieces: list[str] = []
    completion_tokens = None
    try:
        if target.stream:
            chunks = 0
            answer = await create(model=target.model, max_tokens=item.output_len, stream=True,
                                  stream_options={"include_usage": True}, **prompt)
            async for chunk in answer:
                if chunk.usage is not None and chunk.usage.completion_tokens is not None:
                    completion_tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text = (choice.delta.content if chat else choice.text) or ""
                    if text:
                        at = time.perf_counter()
                        sample.first = at if sample.first is None else sample.first
                        sample.last = at
                        pieces.append(text)
                        chunks += 1
            target.chunked += chunks > 1
        else:
            answer = await create(model=target.model, max_tokens=item.output_len, stream=False, **prompt)
            if answer.usage is not None:
                completion_tokens = answer.usage.completion_tokens
            for choice in answer.choices:
                pieces.append((choice.message.content if chat else choice.text) or "")
        if completion_tokens is not None:
            sample.output_tokens = completion_tokens
        elif target.count_text is not None:
            sample.output_tokens = target.count_text("".join(pieces))
        else:
            sample.output_tokens = None  # unmeasured: no usage and no tokenizer
    except openai.APIStatusError as exc:
        sample.error = f"{exc.status_code}: {exc.message}"
    except openai.APIConnectionError as exc:
        sample.error = f"connection: {_cause(exc)}"
    except Exception as exc:  # a broken answer counts as a failed request, not a crashed bench
        sample.error = f"{type(exc).__name__}: {exc}"
    sample.done = time.perf_counter()


async def _load(target: OpenAITarget, items: list[Item], *, concurrency: int | None, request_rate: float | None,
                arrivals: str, timeout_s: float, seed: int) -> tuple[list[Sample], float]:
    import httpx
    import openai

    workers = concurrency or len(items)
    limits = httpx.Limits(max_connections=workers + 4, max_keepalive_connections=workers + 4)
    async with openai.AsyncOpenAI(base_url=target.url, api_key=target.api_key, max_retries=0, timeout=timeout_s,
                                  http_client=httpx.AsyncClient(limits=limits, timeout=timeout_s)) as client:
        started = time.perf_counter()
        if request_rate is not None:  # open loop: latency runs from each request's scheduled arrival
            times = arrival_times(len(items), started, request_rate=request_rate, arrivals=arrivals, seed=seed)
            samples = [Sample(sent=at) for at in times]

            async def arrive(item: Item, sample: Sample) -> None:
                await asyncio.sleep(max(0.0, sample.sent - time.perf_counter()))
                await _one(client, target, item, sample)

            await asyncio.gather(*(arrive(i, s) for i, s in zip(items, samples)))
        else:
            samples = [Sample(sent=started) for _ in items]
            work = iter(zip(items, samples))

            async def worker() -> None:
                for item, sample in work:  # one shared iterator: each item goes to one worker
                    sample.sent = time.perf_counter()
                    await _one(client, target, item, sample)

            await asyncio.gather(*(worker() for _ in range(min(workers, len(items)))))
    end = max((s.done for s in samples), default=started)
    return samples, end - min((s.sent for s in samples), default=started)


def run(target: OpenAITarget, items: list[Item], *, concurrency: int | None = None, request_rate: float | None = None,
        arrivals: str = "poisson", timeout_s: float = 600.0, seed: int = 0) -> tuple[list[Sample], float]:
    """Send every item to the server; closed loop with ``concurrency`` in flight, or open loop at ``request_rate``."""
    if (concurrency is None) == (request_rate is None):
        raise UsageError("give exactly one of --concurrency and --request-rate")
    return asyncio.run(_load(target, items, concurrency=concurrency, request_rate=request_rate, arrivals=arrivals,
                             timeout_s=timeout_s, seed=seed))


def measure(target: OpenAITarget, items: list[Item], load_points: list, *, warmup: int, timeout_s: float,
            progress=None) -> list[dict[str, Any]]:
    """One summary row per load point (the rows of :func:`forge.loadgen.targets.measure`)."""
    if warmup > 0:
        run(target, items[:warmup], concurrency=1, timeout_s=timeout_s)
    target.chunked = 0
    rows = []
    for load in load_points:
        samples, wall = run(target, items, concurrency=load.concurrency, request_rate=load.rate,
                            arrivals=load.arrivals, timeout_s=timeout_s)
        rows.append({"target": target.label, "load": load.label, "concurrency": load.concurrency,
                     "request_rate": load.rate, "arrivals": load.arrivals, **summarize(samples, wall)})
        if progress:
            row = rows[-1]
            tokens = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.1f}"
            progress(f"{target.label}, {load.label}: {row['req_per_s']:.2f} req/s, {tokens} tok/s, "
                     f"{row['errors']} errors")
    return rows


def notes(target: OpenAITarget, rows: list[dict[str, Any]]) -> list[str]:
    """What the reader of the numbers should know: answers streamed whole, tokens not counted."""
    said = []
    if target.stream and target.chunked == 0 and any(row["succeeded"] for row in rows):
        said.append("every streamed answer came in one chunk (a server that does not stream token by token, e.g. "
                    "a forge repository built without --decoupled): TTFT is the whole latency")
    if any(row["tokens_per_s"] is None for row in rows):
        said.append("the server reported no usage and no --tokenizer was given: generated tokens not counted")
    return said
