"""``/v1/chat/completions``: a chat request as one generation, and its answer whole or as chunks."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from . import translate as rq
from .catalog import Catalog
from .front import Front
from .generation import Outcome, generate, usage
from .protocol import ChatRequest


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
    return rq.Generation(prompt, rq.max_tokens(catalog, asked, prompt_tokens, None), prompt_tokens,
                         rq.sampling(body), body.stops(), guide, image, tools)


def _message(text: str, tools: str | None) -> tuple[dict[str, Any], str | None]:
    calls = rq.tool_calls(text, tools)
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls, "refusal": None}, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None}, None


async def answer(front: Front, body: ChatRequest, generation: rq.Generation, adapter, ident: str,
                 created: int) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    outcome = Outcome()
    pieces = [p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                        request_id=ident)]
    message, reason = _message("".join(pieces), generation.tools)
    return {"id": ident, "object": "chat.completion", "created": created, "model": body.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": reason or outcome.finish_reason}],
            "usage": usage(outcome)}


async def chunks(front: Front, body: ChatRequest, generation: rq.Generation, adapter, ident: str,
                 created: int) -> AsyncIterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` events: the role, the content as generated (a tool call whole), the
    finish reason, the usage when asked."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        event = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
                 "system_fingerprint": None,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if with_usage:
            event["usage"] = None
        return event

    outcome = Outcome()
    yield chunk({"role": "assistant", "content": ""})
    held: list[str] = []  # an answer that may be a tool call is sent whole, once it is known
    async for piece in generate(front, generation, adapter, stream=True, outcome=outcome, request_id=ident):
        if generation.tools:
            held.append(piece)
        else:
            yield chunk({"content": piece})
    reason = outcome.finish_reason
    if generation.tools:
        message, called = _message("".join(held), generation.tools)
        if called:
            reason = called
            yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]})
        elif message["content"]:
            yield chunk({"content": message["content"]})
    yield chunk({}, reason)
    if with_usage:
        yield {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
               "system_fingerprint": None, "choices": [], "usage": usage(outcome)}
