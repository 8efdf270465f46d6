"""``/v1/chat/completions``: a chat request as one generation, and its answer whole or as chunks."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from . import translate as rq
from .catalog import Catalog
from .extensions import extend, served_inputs
from .front import Front
from .generation import Outcome, chunk_usage, generate, merged, total_usage
from .protocol import ChatRequest
from .schema import (AssistantMessage, CalledFunction, ChatChoice, ChatCompletion, ChatCompletionChunk,
                     ChatLogprobs, ChunkChoice, Delta, ToolCall)


async def prepare(front: Front, body: ChatRequest) -> list[rq.Generation]:
    """The ``n`` generations ``body`` asks for, templated and counted on a worker thread (a long prompt blocks no
    other request)."""
    front.generator()
    generation = await asyncio.to_thread(_generation, front.catalog, body)
    return [generation.varied(j, body.seed is not None) for j in range(body.n)]


def _generation(catalog: Catalog, body: ChatRequest) -> rq.Generation:
    model = catalog.generator
    prompt, image = rq.chat_prompt(catalog, body)
    guide, tools = rq.chat_guide(body)
    prompt_tokens = model.count(prompt) if model.tokenizer is not None else None
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    budget = rq.max_tokens(catalog, asked, prompt_tokens, None)
    extended = extend(catalog, model, body, budget)
    inputs = {**extended.inputs, **served_inputs(model, rq.sampling(body))}  # greedy's top_k 1 wins
    return rq.Generation(prompt, budget, prompt_tokens, inputs, rq.stops(body) + extended.stops, guide, image, tools,
                         extended.include_stop, logprobs=(body.top_logprobs or 0) if body.logprobs else None)


def _message(text: str, tools: str | None) -> tuple[AssistantMessage, str | None]:
    calls = rq.tool_calls(text, tools)
    if calls:
        called = [ToolCall(id=c["id"], function=CalledFunction(**c["function"])) for c in calls]
        return AssistantMessage(content=None, tool_calls=called), "tool_calls"
    return AssistantMessage(content=text), None


def _scores(front: Front, body: ChatRequest, positions: list) -> ChatLogprobs | None:
    return front.catalog.shapes().chat(positions, body.top_logprobs or 0) if body.logprobs else None


async def answer(front: Front, body: ChatRequest, generations: list[rq.Generation], adapter, ident: str,
                 created: int) -> ChatCompletion:
    """The ``chat.completion`` object, ``n`` choices."""
    async def one(index: int, generation: rq.Generation) -> tuple[ChatChoice, Outcome]:
        outcome = Outcome()
        pieces = [p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                            request_id=f"{ident}-{index}" if index else ident)]
        message, reason = _message("".join(pieces), generation.tools)
        echo = rq.echoed(body)
        if echo:
            message.content = echo + (message.content or "")
        return ChatChoice(index=index, message=message, logprobs=_scores(front, body, outcome.positions),
                          finish_reason=reason or outcome.finish_reason), outcome

    answers = await asyncio.gather(*(one(i, g) for i, g in enumerate(generations)))
    return ChatCompletion(id=ident, created=created, model=body.model, choices=[c for c, _ in answers],
                          usage=total_usage([o for _, o in answers]))


async def chunks(front: Front, body: ChatRequest, generations: list[rq.Generation], adapter, ident: str,
                 created: int) -> AsyncIterator[ChatCompletionChunk]:
    """The ``chat.completion.chunk`` events of every choice as they come: the role, the content as generated (a
    tool call whole), the finish reason; the usage last when asked."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    outcomes = [Outcome() for _ in generations]

    def chunk(index: int, delta: Delta, reason: str | None = None, scores=None) -> ChatCompletionChunk:
        choices = [ChunkChoice(index=index, delta=delta, logprobs=scores, finish_reason=reason)]
        return ChatCompletionChunk(id=ident, created=created, model=body.model, choices=choices,
                                   **chunk_usage(body.stream_options, outcomes[index], generations[index]))

    async def one(index: int, generation: rq.Generation) -> AsyncIterator[ChatCompletionChunk]:
        outcome = outcomes[index]
        yield chunk(index, Delta(role="assistant", content=""))
        echo = rq.echoed(body)
        if echo:
            yield chunk(index, Delta(content=echo))
        held: list[str] = []  # an answer that may be a tool call is sent whole, once it is known
        sent = 0
        async for piece in generate(front, generation, adapter, stream=True, outcome=outcome,
                                    request_id=f"{ident}-{index}" if index else ident):
            if generation.tools:
                held.append(piece)
                continue
            new, sent = outcome.positions[sent:], len(outcome.positions)
            yield chunk(index, Delta(content=piece), scores=_scores(front, body, new))
        reason = outcome.finish_reason
        if generation.tools:
            message, called = _message("".join(held), generation.tools)
            if called:
                reason = called
                calls = [call.model_copy(update={"index": i}) for i, call in enumerate(message.tool_calls)]
                yield chunk(index, Delta(tool_calls=calls))
            elif message.content:
                yield chunk(index, Delta(content=message.content), scores=_scores(front, body, outcome.positions))
        elif body.logprobs and sent < len(outcome.positions):
            yield chunk(index, Delta(content=""), scores=_scores(front, body, outcome.positions[sent:]))
        yield chunk(index, Delta(), reason)

    async for item in merged([one(i, g) for i, g in enumerate(generations)]):
        yield item
    if with_usage:
        yield ChatCompletionChunk(id=ident, created=created, model=body.model, choices=[],
                                  usage=total_usage(outcomes))
