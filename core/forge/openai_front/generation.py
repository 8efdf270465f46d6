"""One generation of the served generator, as text pieces: stop strings applied, tokens counted, adapters sent.

Tokenizer calls run on a worker thread (``asyncio.to_thread``): a long text keeps no other request waiting.
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import aclosing
from typing import AsyncIterator

from ..clients.inference import EXCLUDE_INPUT, first_input
from ..clients.lora_requests import UNKNOWN_TASK, ServedAdapter
from . import logprobs
from . import translate as rq
from .catalog import TextModel
from .front import Front
from .metrics import Clock
from .protocol import APIError
from .schema import Usage
from .upstream import first_int, strings
from .vllm_interface import with_adapter


class Outcome:
    """What a finished generation reports besides its text."""

    def __init__(self):
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.finish_reason = "stop"
        self.positions: list[logprobs.Scored] = []  # of the generated tokens (log-probs asked), as they come
        self.prompt_positions: list[logprobs.Scored | None] | None = None  # of the prompt's (an echo's)


async def generate(front: Front, generation: rq.Generation, adapter: ServedAdapter | None, *, stream: bool,
                   outcome: Outcome, request_id: str, measured: bool = True) -> AsyncIterator[str]:
    """The generated text in pieces (one piece when the model is not decoupled), stop strings applied; counted in
    the front's metrics unless not ``measured`` (a health probe)."""
    model = front.generator()
    clock = front.metrics.clock(stream) if measured else None
    try:
        async with aclosing(_pieces(front, model, generation, adapter, stream, outcome, request_id, clock)) as pieces:
            async for piece in pieces:
                yield piece
    except (GeneratorExit, asyncio.CancelledError):
        if clock is not None:
            clock.aborted()
        raise
    except BaseException:
        if clock is not None:
            clock.failed()
        raise
    if clock is not None:
        clock.finished(outcome.finish_reason, outcome.prompt_tokens, outcome.completion_tokens)


async def _pieces(front: Front, model: TextModel, generation: rq.Generation, adapter: ServedAdapter | None,
                  stream: bool, outcome: Outcome, request_id: str, clock: Clock | None) -> AsyncIterator[str]:
    tensors = rq.tensors(model, generation, stream=stream)
    echoes = first_input(model.inputs, EXCLUDE_INPUT) is None  # older profiles: the prompt comes back too
    stop = rq.StopText(generation.stops, generation.include_stop)
    texts: list[str] = []
    reason = None  # the model's own finish reason, where it answers one (the LLM-API interface)
    for attempt in (0, 1):
        first = adapter is not None and attempt == 1
        extra = front.lora_tensors(adapter, first)
        try:
            sent = with_adapter(model.inputs, {**tensors, **extra}, adapter)  # a vLLM-backend model's lora_name
            async with aclosing(front.triton.generate(model.inputs, sent, request_id,
                                                      stopper=front.catalog.stopper)) as responses:
                async for outputs in responses:
                    if clock is not None:
                        clock.response()
                    piece = "".join(strings(outputs.get("text_output")))
                    _scored(outputs, generation, outcome)
                    ended = [r for r in strings(outputs.get("finish_reason")) if r in ("stop", "length")]
                    reason = ended[0] if ended else reason
                    outcome.prompt_tokens = first_int(outputs.get("num_input_tokens")) or outcome.prompt_tokens
                    count = first_int(outputs.get("num_output_tokens"))
                    if count is not None:
                        outcome.completion_tokens = count
                    if not generation.answer:
                        continue  # max_tokens 0: the token generated to score the prompt is not shown
                    texts.append(piece)
                    if echoes:
                        continue
                    out = stop.feed(piece)
                    if out:
                        yield out
                    if stop.stopped:
                        break  # closing the responses stops the rest of the generation on the server
            break
        except APIError as exc:
            if adapter is None or attempt or UNKNOWN_TASK not in exc.message or adapter.weights is None:
                raise
    if echoes:
        texts = [await asyncio.to_thread(_without_prompt, "".join(texts), generation.prompt, model)]
        out = stop.feed(texts[0])
        if out:
            yield out
    tail = stop.flush()
    if tail:
        yield tail
    if outcome.prompt_tokens is None:
        outcome.prompt_tokens = generation.prompt_tokens
    if outcome.completion_tokens is None and model.tokenizer is not None:
        outcome.completion_tokens = await asyncio.to_thread(model.count, "".join(texts), special=False)
    if not generation.answer:
        outcome.completion_tokens, outcome.finish_reason, outcome.positions = 0, "length", []
    elif stop.stopped:
        outcome.finish_reason = "stop"
    elif reason is not None:
        outcome.finish_reason = reason
    elif outcome.completion_tokens is not None and outcome.completion_tokens >= generation.max_tokens:
        outcome.finish_reason = "length"


def _scored(outputs: dict, generation: rq.Generation, outcome: Outcome) -> None:
    """The log-probs a response carries, into ``outcome``."""
    if generation.logprobs is not None:
        for text in strings(outputs.get("logprobs")):
            outcome.positions.extend(logprobs.parse(text, generation.logprobs))
    if generation.prompt_logprobs is not None:
        for text in strings(outputs.get("prompt_logprobs")):
            outcome.prompt_positions = logprobs.parse(text, generation.prompt_logprobs)


def _without_prompt(whole: str, prompt: str, model: TextModel) -> str:
    """An echoing profile's answer without its prompt (as the postprocessing decoded it, or as sent)."""
    shown = [prompt]
    if model.tokenizer is not None and not hasattr(model.tokenizer, "max_length"):
        from ..in_triton import forge_text

        ids = forge_text.token_ids(prompt, model.tokenizer, model.add_special_tokens)
        shown.insert(0, forge_text.decode(model.tokenizer, ids, True))
    for text in shown:
        if whole.startswith(text):
            return whole[len(text):]
    return whole


def chunk_usage(options, outcome: Outcome, generation: rq.Generation) -> dict[str, Usage | None]:
    """A streamed chunk's ``usage`` keyword, by the request's ``stream_options``: the usage so far with vLLM's
    ``continuous_usage_stats`` (where the model counts its tokens), ``null`` until the last chunk with
    ``include_usage``, else none."""
    if options is not None and options.continuous_usage_stats:
        return {"usage": Usage.of(outcome.prompt_tokens or generation.prompt_tokens, outcome.completion_tokens)}
    return {"usage": None} if options is not None and options.include_usage else {}


def usage(outcome: Outcome) -> Usage | None:
    """OpenAI's ``usage`` of one generation (``None`` where a count is unknown)."""
    return Usage.of(outcome.prompt_tokens, outcome.completion_tokens)


def total_usage(outcomes: list[Outcome]) -> Usage | None:
    """The ``usage`` of several generations together (``None`` where one of them is unknown)."""
    return Usage.total([usage(o) for o in outcomes])

async def probe(front: Front, timeout: float) -> tuple[bool, str]:
    """Whether the served model answers within ``timeout`` s: one token generated (an embedding-only repository:
    one short text embedded), left out of the metrics; the reason when it does not."""
    catalog = front.catalog

    async def one_token() -> None:
        generation = rq.Generation("Hello", max_tokens=1)
        async for _ in generate(front, generation, None, stream=False, outcome=Outcome(),
                                request_id=f"health-{secrets.token_hex(6)}", measured=False):
            pass

    async def one_embedding() -> None:
        model = catalog.embedder
        await front.triton.infer(model.inputs, {"text_input": model.inputs.array("text_input", "Hello")}, "",
                                 ["embedding"])

    if catalog.generator is None and catalog.embedder is None:
        return False, "the repository serves no model behind the API"
    try:
        await asyncio.wait_for(one_token() if catalog.generator is not None else one_embedding(), timeout)
    except asyncio.TimeoutError:
        return False, f"no answer within {timeout:g} s"
    except APIError as exc:
        return False, exc.message
    return True, "ok"


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several streams (the choices of one request) as they come; the first error ends them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    await queue.put(item)
        except Exception as exc:  # noqa: BLE001 - raised where the items are read
            await queue.put(exc)
        finally:
            await queue.put(ended)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is ended:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
