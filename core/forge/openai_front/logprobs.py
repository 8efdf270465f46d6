"""Log-probabilities as the served model reports them and as OpenAI's two shapes show them.

The model (forge's python target) answers ``logprobs`` / ``prompt_logprobs`` as Triton's vLLM backend does: JSON,
one object per token, token id → ``{"logprob", "rank", "decoded_token"}``, the generated (or prompt) token
first. Here each becomes a :class:`Scored`; its text and bytes come from the front's own copy of the tokenizer
(exact bytes, also for a token that is part of a character). Chat shows the ``top_logprobs`` most likely tokens
of each position; the legacy completions shape shows the token and the alternatives in one ``top_logprobs``
dict, as vLLM does. A log-prob of -inf is shown as -9999.0 (JSON has no infinity).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .protocol import APIError
from .schema import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

FLOOR = -9999.0


@dataclass(frozen=True)
class Token:
    id: int
    logprob: float
    rank: int


@dataclass(frozen=True)
class Scored:
    """One position: the token there and the most likely tokens, best first."""

    token: Token
    alternatives: tuple[Token, ...]


def parse(text: str, alternatives: int) -> list[Scored | None]:
    """The positions of one ``logprobs`` / ``prompt_logprobs`` output (null stays None), ``alternatives`` each."""
    try:
        objects = json.loads(text)
        found: list[Scored | None] = []
        for entry in objects:
            if entry is None:
                found.append(None)
                continue
            tokens = [Token(int(k), float(v["logprob"]), int(v["rank"])) for k, v in entry.items()]
            ranked = sorted(tokens, key=lambda t: t.rank)[:alternatives]
            found.append(Scored(tokens[0], tuple(ranked)))
        return found
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise APIError(502, f"the served model's log-probs are not what forge reads: {text[:80]!r}",
                       code="bad_upstream_answer") from None


def _value(logprob: float) -> float:
    return FLOOR if math.isinf(logprob) or math.isnan(logprob) else max(logprob, FLOOR)


class Shapes:
    """OpenAI's log-prob objects of positions, with token texts from ``codec`` (forge_text.TokenBytes)."""

    def __init__(self, codec):
        self.codec = codec

    def raw(self, token: int) -> bytes:
        return self.codec.bytes_of([token], at_start=False)

    def text(self, token: int) -> str:
        return self.raw(token).decode("utf-8", "replace")

    def chat(self, positions: list[Scored], top: int) -> ChatLogprobs:
        def one(t: Token) -> TopLogprob:
            return TopLogprob(token=self.text(t.id), logprob=_value(t.logprob), bytes=list(self.raw(t.id)))

        content = [TokenLogprob(token=self.text(p.token.id), logprob=_value(p.token.logprob),
                                bytes=list(self.raw(p.token.id)), top_logprobs=[one(t) for t in p.alternatives[:top]])
                   for p in positions]
        return ChatLogprobs(content=content)

    def completion(self, tokens: list[int], positions: list[Scored | None], offset: int = 0) -> CompletionLogprobs:
        """The legacy shape of ``tokens`` (their positions beside them; None: the first prompt token), text
        offsets counted from ``offset``."""
        texts, offsets = [], []
        for token in tokens:
            offsets.append(offset)
            texts.append(self.text(token))
            offset += len(texts[-1])
        tops = [None if p is None else {self.text(t.id): _value(t.logprob) for t in (p.token, *p.alternatives)}
                for p in positions]
        return CompletionLogprobs(tokens=texts, token_logprobs=[None if p is None else _value(p.token.logprob)
                                                                for p in positions],
                                  top_logprobs=tops, text_offset=offsets)
