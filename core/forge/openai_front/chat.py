"""``/v1/chat/completions``: a chat request as one generation, and its answer whole or as chunks."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from . import translate as rq
from .catalog import Catalog
from .extensions import extend, served_inputs
from .front import Front
from .generation import Outcome, generate, usage
from .protocol import ChatRequest
from .schema import (AssistantMessage, CalledFunction, ChatChoice, ChatCompletion, ChatCompletionChunk,
                     ChunkChoice, Delta, ToolCall)


async def prepare(front: Front, body: ChatRequest) -> rq.Generation:
    """The generation ``body`` asks for, templated and counted on a worker thread (a long prompt blocks no
    other request)."""
    front.generator()
    return await asyncio.to_thread(_generation, front.catalog, body)


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
                         extended.include_stop)


def _message(text: str, tools: str | None) -> tuple[AssistantMessage, str | None]:
    calls = rq.tool_calls(text, tools)
    if calls:
        called = [ToolCall(id=c["id"], function=CalledFunction(**c["function"])) for c in calls]
        return AssistantMessage(content=None, tool_calls=called), "tool_calls"
    return AssistantMessage(content=text), None


async def answer(front: Front, body: ChatRequest, generation: rq.Generation, adapter, ident: str,
                 created: int) -> ChatCompletion:
    """The ``chat.completion`` object."""
    outcome = Outcome()
    pieces = [p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                        request_id=ident)]
    message, reason = _message("".join(pieces), generation.tools)
    echo = rq.echoed(body)
    if echo:
        message.content = echo + (message.content or "")
    return ChatCompletion(id=ident, created=created, model=body.model, usage=usage(outcome),
                          choices=[ChatChoice(index=0, message=message, finish_reason=reason or outcome.finish_reason)])


async def chunks(front: Front, body: ChatRequest, generation: rq.Generation, adapter, ident: str,
                 created: int) -> AsyncIterator[ChatCompletionChunk]:
    """The ``chat.completion.chunk`` events: the role, the content as generated (a tool call whole), the
    finish reason, the usage when asked."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: Delta, reason: str | None = None) -> ChatCompletionChunk:
        choices = [ChunkChoice(index=0, delta=delta, finish_reason=reason)]
        if with_usage:
            return ChatCompletionChunk(id=ident, created=created, model=body.model, choices=choices, usage=None)
        return ChatCompletionChunk(id=ident, created=created, model=body.model, choices=choices)

    outcome = Outcome()
    yield chunk(Delta(role="assistant", content=""))
    echo = rq.echoed(body)
    if echo:
        yield chunk(Delta(content=echo))
    held: list[str] = []  # an answer that may be a tool call is sent whole, once it is known
    async for piece in generate(front, generation, adapter, stream=True, outcome=outcome, request_id=ident):
        if generation.tools:
            held.append(piece)
        else:
            yield chunk(Delta(content=piece))
    reason = outcome.finish_reason
    if generation.tools:
        message, called = _message("".join(held), generation.tools)
        if called:
            reason = called
            calls = [call.model_copy(update={"index": i}) for i, call in enumerate(message.tool_calls)]
            yield chunk(Delta(tool_calls=calls))
        elif message.content:
            yield chunk(Delta(content=message.content))
    yield chunk(Delta(), reason)
    if with_usage:
        yield ChatCompletionChunk(id=ident, created=created, model=body.model, choices=[], usage=usage(outcome))
