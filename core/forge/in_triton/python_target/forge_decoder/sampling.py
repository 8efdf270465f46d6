"""Choose the next token of every running sequence from its logits, with its own parameters.

Order as in TensorRT-LLM: embedding bias, bad words and min length, penalties, temperature,
then top-k / top-p sampling (or argmax when the sequence is greedy). Each sequence samples
with its own seeded generator, so a seed reproduces its tokens whatever else is batched with it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

NEG_INF = float("-inf")


class Row(Protocol):
    """What the sampler needs to know about one running sequence."""

    request: "object"  # request.GenerationRequest
    tokens: list[int]  # prompt + generated so far
    generated: int  # tokens generated so far
    generator: torch.Generator | None
    top_p: float  # current top-p (runtime_top_p_decay changes it)
    bias: torch.Tensor | None  # embedding bias on the logits' device
    matcher: "object | None"  # guided.Matcher: the engine masks the row's logits before ``choose``


def _banned(words: list[list[int]], tokens: list[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the sequence now."""
    banned = []
    for word in words:
        head = word[:-1]
        if not head or (len(tokens) >= len(head) and tokens[-len(head):] == head):
            banned.append(word[-1])
    return banned


def _untouched(row: Row, end_banned: bool = False) -> bool:
    """Whether ``process`` leaves the row's logits as they are (no bias, bad words, min length,
    penalties or temperature apply now). ``process`` skips exactly these rows. ``end_banned``: but for the
    row's end_id, which min_length bans from this token alone."""
    req = row.request
    s = req.sampling
    ends_banned = banned_end(row) != -1
    return (row.bias is None and not req.bad_words and not s.penalised
            and not (ends_banned and not (end_banned and s.min_length <= row.generated + 1))
            and (s.greedy or s.temperature in (0.0, 1.0)))


def plain_greedy(row: Row, end_banned: bool = False) -> bool:
    """Whether the row's next token is the argmax of its raw logits (and ``choose`` would change nothing else);
    never for a guided row, whose grammar masks its logits first. ``end_banned``: the argmax without its end_id
    where min_length bans that from this token alone (a prompt's first token with min_length 1, the default:
    ``banned_end`` names it)."""
    s = row.request.sampling
    return (s.greedy and _untouched(row, end_banned) and s.top_p_decay == 1.0 and s.top_p_reset_id is None
            and getattr(row, "matcher", None) is None)


def banned_end(row: Row) -> int:
    """The end_id that min_length bans from the row's next token, or -1."""
    req = row.request
    return req.end_id if req.end_id is not None and row.generated < req.sampling.min_length else -1


def process(logits: torch.Tensor, rows: Sequence[Row]) -> torch.Tensor:
    """Apply bias, bad words, min length, penalties and temperature; return float32 logits (a copy where a row
    changes: the caller's logits stay the model's, for log-probs and generation logits)."""
    changed = logits.dtype == torch.float32 and not all(_untouched(row) for row in rows)
    logits = logits.clone() if changed else logits.float()
    vocab = logits.shape[-1]
    for i, row in enumerate(rows):
        if _untouched(row):
            continue
        req = row.request
        if row.bias is not None:
            logits[i] += row.bias
        banned = _banned(req.bad_words, row.tokens) if req.bad_words else []
        if banned_end(row) != -1:
            banned.append(req.end_id)
        banned = [t for t in banned if 0 <= t < vocab]
        if banned:
            logits[i, banned] = NEG_INF
        s = req.sampling
        if s.penalised:
            history = torch.tensor(row.tokens, dtype=torch.long, device=logits.device)
            history = history[history < vocab]  # prompt-table ids are not tokens of the vocabulary
            counts = torch.bincount(history, minlength=vocab)[:vocab].to(logits.dtype)
            seen = counts > 0
            if s.repetition_penalty != 1.0:
                scaled = torch.where(logits[i] > 0, logits[i] / s.repetition_penalty,
                                     logits[i] * s.repetition_penalty)
                logits[i] = torch.where(seen, scaled, logits[i])
            if s.presence_penalty:
                logits[i] -= s.presence_penalty * seen.to(logits.dtype)
            if s.frequency_penalty:
                logits[i] -= s.frequency_penalty * counts
        if not s.greedy and s.temperature not in (0.0, 1.0):
            logits[i] /= s.temperature
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        threshold = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < threshold, NEG_INF)
    if 0.0 < top_p < 1.0:
        ordered, index = torch.sort(logits, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # keep the smallest prefix whose probability reaches top_p (always the first token)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        ordered = ordered.masked_fill(drop, NEG_INF)
        logits = torch.full_like(logits, NEG_INF).scatter(0, index, ordered)
    return logits


def _draw(processed: torch.Tensor, sampled: list[int], rows: Sequence[Row], argmax: torch.Tensor) -> torch.Tensor:
    """A token for each row of ``sampled`` from the softmax of its top-k / top-p filtered logits: where its
    cumulative distribution first passes a uniform draw of the row's own generator (the distribution
    ``torch.multinomial`` draws, without its pass over the vocabulary per row: 50 µs against 1 ms for a
    49k vocabulary on a CPU). A draw that rounding puts past the last probability takes the argmax."""
    filtered = torch.stack([_top_k_top_p(processed[i], rows[i].request.sampling.top_k, rows[i].top_p)
                            for i in sampled])
    cdf = torch.softmax(filtered, dim=-1).cumsum_(dim=-1)
    draws = torch.cat([torch.rand(1, generator=rows[i].generator, device=cdf.device) for i in sampled])
    drawn = torch.searchsorted(cdf, (draws * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    return torch.where(drawn < cdf.shape[-1], drawn, argmax[sampled])


def choose(logits: torch.Tensor, rows: Sequence[Row]) -> tuple[list[int], list[float]]:
    """The next token of every row and its log-probability under the processed distribution."""
    processed = process(logits, rows)
    logprobs = torch.log_softmax(processed, dim=-1)
    tokens = torch.argmax(processed, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.request.sampling.greedy]
    if sampled:
        tokens[sampled] = _draw(processed, sampled, rows, tokens)
    chosen = tokens.tolist()
    picked = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
    for row, token in zip(rows, chosen):
        s = row.request.sampling
        if s.top_p_decay != 1.0 or s.top_p_reset_id is not None:
            if token == s.top_p_reset_id:
                row.top_p = s.top_p
            else:
                row.top_p = max(row.top_p * s.top_p_decay, s.top_p_min)
    return chosen, picked
