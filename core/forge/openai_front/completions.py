"""``/v1/completions``: one generation per prompt (run concurrently), the answer whole or as chunks."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from . import translate as rq
from .catalog import Catalog
from .extensions import extend, served_inputs
from .front import Front
from .generation import Outcome, generate, total_usage
from .protocol import APIError, CompletionRequest, valid_text
from .schema import Completion, CompletionChoice


async def prepare(front: Front, body: CompletionRequest) -> list[rq.Generation]:
    """The generations ``body`` asks for, one a prompt, counted on a worker thread (a long prompt blocks no
    other request)."""
    front.generator()
    return await asyncio.to_thread(_generations, front.catalog, body)


def _generations(catalog: Catalog, body: CompletionRequest) -> list[rq.Generation]:
    model = catalog.generator
    found = []
    stops, sampling = rq.stops(body), served_inputs(model, rq.sampling(body))
    for prompt in [body.prompt] if isinstance(body.prompt, str) else list(body.prompt):
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        valid_text(prompt, "prompt")
        count = model.count(prompt) if model.tokenizer is not None else None
        budget = rq.max_tokens(catalog, body.max_tokens, count, 16)
        extended = extend(catalog, model, body, budget)
        found.append(rq.Generation(prompt, budget, count, {**extended.inputs, **sampling}, stops + extended.stops,
                                   include_stop=extended.include_stop))
    return found


async def answer(front: Front, body: CompletionRequest, generations: list[rq.Generation], adapter, ident: str,
                 created: int) -> Completion:
    """The ``text_completion`` object, a choice per prompt."""
    async def one(index: int, generation: rq.Generation):
        outcome = Outcome()
        text = "".join([p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                                  request_id=f"{ident}-{index}")])
        return CompletionChoice(index=index, text=(generation.prompt + text) if body.echo else text,
                                finish_reason=outcome.finish_reason), outcome

    answers = await asyncio.gather(*(one(i, g) for i, g in enumerate(generations)))
    return Completion(id=ident, created=created, model=body.model, choices=[c for c, _ in answers],
                      usage=total_usage([o for _, o in answers]))


async def chunks(front: Front, body: CompletionRequest, generations: list[rq.Generation], adapter, ident: str,
                 created: int) -> AsyncIterator[Completion]:
    """The ``text_completion`` events of every prompt as they come, then the usage when asked."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    queue: asyncio.Queue = asyncio.Queue()
    outcomes = [Outcome() for _ in generations]

    def chunk(index: int, text: str, reason: str | None = None) -> Completion:
        choices = [CompletionChoice(index=index, text=text, finish_reason=reason)]
        if with_usage:
            return Completion(id=ident, created=created, model=body.model, choices=choices, usage=None)
        return Completion(id=ident, created=created, model=body.model, choices=choices)

    async def run(index: int, generation: rq.Generation):
        try:
            if body.echo:
                await queue.put(chunk(index, generation.prompt))
            async for piece in generate(front, generation, adapter, stream=True, outcome=outcomes[index],
                                        request_id=f"{ident}-{index}"):
                await queue.put(chunk(index, piece))
            await queue.put(chunk(index, "", outcomes[index].finish_reason))
        except APIError as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(run(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
    if with_usage:
        yield Completion(id=ident, created=created, model=body.model, choices=[], usage=total_usage(outcomes))
