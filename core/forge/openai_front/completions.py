"""``/v1/completions``: one generation per prompt (run concurrently), the answer whole or as chunks."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from . import translate as rq
from .catalog import Catalog
from .extensions import extend, served_inputs
from .front import Front
from .generation import Outcome, chunk_usage, generate, merged, total_usage
from .protocol import APIError, CompletionRequest, valid_text
from .schema import Completion, CompletionChoice


async def prepare(front: Front, body: CompletionRequest) -> list[rq.Generation]:
    """The generations ``body`` asks for, ``n`` a prompt, counted on a worker thread (a long prompt blocks no
    other request)."""
    front.generator()
    found = await asyncio.to_thread(_generations, front.catalog, body)
    return [g.varied(j, body.seed is not None) for g in found for j in range(body.n)]


def _generations(catalog: Catalog, body: CompletionRequest) -> list[rq.Generation]:
    model = catalog.generator
    found = []
    stops, sampling = rq.stops(body), served_inputs(model, rq.sampling(body))
    scored = body.logprobs is not None and body.echo  # the prompt's log-probs: the tokens they belong to are needed
    for prompt in body.prompts():
        ids = _ids(model, prompt) if not isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt must not be empty", param="prompt")
            valid_text(prompt, "prompt")
            if scored and model.tokenizer is not None:  # sent as the ids the echo's log-probs are shown for
                ids = model.token_ids(prompt)
        text = prompt if isinstance(prompt, str) else model.decode(ids)
        count = len(ids) if ids is not None else model.count(prompt) if model.tokenizer is not None else None
        answer = body.max_tokens != 0
        budget = rq.max_tokens(catalog, body.max_tokens if answer else 1, count, 16)
        extended = extend(catalog, model, body, budget)
        found.append(rq.Generation(text, budget, count, {**extended.inputs, **sampling}, stops + extended.stops,
                                   include_stop=extended.include_stop, prompt_ids=ids,
                                   logprobs=body.logprobs if answer else None,
                                   prompt_logprobs=body.logprobs if scored else None, answer=answer))
    return found


def _ids(model, ids: list[int]) -> list[int]:
    """Token ids of a prompt, checked against the served vocabulary."""
    vocab = model.vocab_size
    bad = next((t for t in ids if vocab is not None and t >= vocab), None)
    if bad is not None:
        raise APIError(400, f"prompt: token id {bad} is outside the model's vocabulary (0 … {vocab - 1})",
                       param="prompt", code="invalid_value")
    return list(ids)


def _choice(front: Front, body: CompletionRequest, index: int, generation: rq.Generation, text: str,
            outcome: Outcome) -> CompletionChoice:
    """One whole choice: the echo, the answer, their log-probs."""
    echo = generation.prompt if body.echo else ""
    scores = None
    if body.logprobs is not None:
        shapes = front.catalog.shapes()
        if body.echo:
            tokens = list(generation.prompt_ids or []) + [p.token.id for p in outcome.positions]
            scores = shapes.completion(tokens, (outcome.prompt_positions or []) + outcome.positions)
        else:
            scores = shapes.completion([p.token.id for p in outcome.positions], outcome.positions)
    return CompletionChoice(index=index, text=echo + text, logprobs=scores, finish_reason=outcome.finish_reason)


async def answer(front: Front, body: CompletionRequest, generations: list[rq.Generation], adapter, ident: str,
                 created: int) -> Completion:
    """The ``text_completion`` object, ``n`` choices a prompt."""
    async def one(index: int, generation: rq.Generation):
        outcome = Outcome()
        text = "".join([p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                                  request_id=f"{ident}-{index}")])
        return _choice(front, body, index, generation, text, outcome), outcome

    answers = await asyncio.gather(*(one(i, g) for i, g in enumerate(generations)))
    return Completion(id=ident, created=created, model=body.model, choices=[c for c, _ in answers],
                      usage=total_usage([o for _, o in answers]))


async def chunks(front: Front, body: CompletionRequest, generations: list[rq.Generation], adapter, ident: str,
                 created: int) -> AsyncIterator[Completion]:
    """The ``text_completion`` events of every choice as they come, then the usage when asked."""
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    outcomes = [Outcome() for _ in generations]

    def chunk(index: int, text: str, reason: str | None = None, scores=None) -> Completion:
        choices = [CompletionChoice(index=index, text=text, logprobs=scores, finish_reason=reason)]
        return Completion(id=ident, created=created, model=body.model, choices=choices,
                          **chunk_usage(body.stream_options, outcomes[index], generations[index]))

    async def one(index: int, generation: rq.Generation) -> AsyncIterator[Completion]:
        outcome = outcomes[index]
        scoring = _Scoring(front, body, generation, outcome)
        if body.echo and body.logprobs is None:
            yield chunk(index, generation.prompt)
        async for piece in generate(front, generation, adapter, stream=True, outcome=outcome,
                                    request_id=f"{ident}-{index}"):
            yield chunk(index, scoring.echo() + piece, scores=scoring.next())
        text, scores = scoring.echo(), scoring.next()  # what no piece took: an echo alone, the last tokens'
        if text or (scores is not None and scores.tokens):
            yield chunk(index, text, scores=scores)
        yield chunk(index, "", outcome.finish_reason)

    async for item in merged([one(i, g) for i, g in enumerate(generations)]):
        yield item
    if with_usage:
        yield Completion(id=ident, created=created, model=body.model, choices=[], usage=total_usage(outcomes))


class _Scoring:
    """The log-probs of a streamed choice, chunk by chunk: the echo (and its prompt's) with the first chunk, then
    the positions that came since the last one, their text offsets running on."""

    def __init__(self, front: Front, body: CompletionRequest, generation: rq.Generation, outcome: Outcome):
        self.front, self.body, self.generation, self.outcome = front, body, generation, outcome
        self.echoing = body.echo and body.logprobs is not None
        self.sent = 0
        self.offset = 0

    def echo(self) -> str:
        """The echoed prompt, once, when it goes with the log-probs of the first chunk."""
        return self.generation.prompt if self.echoing else ""

    def next(self):
        if self.body.logprobs is None:
            return None
        new = self.outcome.positions[self.sent:]
        self.sent = len(self.outcome.positions)
        tokens, positions = [p.token.id for p in new], list(new)
        if self.echoing:
            tokens = list(self.generation.prompt_ids or []) + tokens
            positions = (self.outcome.prompt_positions or []) + positions
            self.echoing = False
        scores = self.front.catalog.shapes().completion(tokens, positions, self.offset)
        self.offset += sum(len(t) for t in scores.tokens)
        return scores
