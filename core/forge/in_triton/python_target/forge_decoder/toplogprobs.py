"""Log-probabilities a client reads token by token: the chosen token's and the ``n`` most likely alternatives,
for generated tokens and for the prompt's own tokens (an ``echo`` with log-probs scores the prompt).

They are the model's raw distribution (``log_softmax`` of its logits in float32, before temperature, penalties
or a grammar's mask), as vLLM's default ``raw_logprobs`` and transformers report them; the sampled token is
picked from the processed distribution as before, so asking for log-probs never changes an answer.

One position is a list of ``(token_id, logprob, rank)`` with the token that was chosen (or the prompt's next
token) first and then the alternatives from the most likely down; rank 1 is the most likely token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sequences import Sequence

Position = list[tuple[int, float, int]]  # the chosen (or prompt) token first, then the alternatives


def positions(logits: torch.Tensor, tokens: torch.Tensor, alternatives: int) -> list[Position]:
    """One position per row of ``logits`` ([n, vocab]): ``tokens`` ([n]) with their log-probs and ranks, and
    the ``alternatives`` most likely tokens."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tokens = tokens.to(logprobs.device).view(-1, 1)
    chosen = logprobs.gather(1, tokens)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    found: list[Position] = [[(t, lp, r)] for t, lp, r in zip(tokens.view(-1).tolist(), chosen.view(-1).tolist(),
                                                                ranks.tolist())]
    if alternatives > 0:
        values, ids = logprobs.topk(min(alternatives, logprobs.shape[-1]), dim=-1)
        for position, row_ids, row_values in zip(found, ids.tolist(), values.tolist()):
            position.extend((i, v, rank) for rank, (i, v) in enumerate(zip(row_ids, row_values), start=1))
    return found


def prompt_positions(logits: torch.Tensor, prompt: list[int], alternatives: int) -> list[Position | None]:
    """The prompt's positions from its prefill's logits ([len(prompt), vocab], one per prompt token): the first
    token has none (nothing predicts it), each later one is scored by the logits before it."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    following = torch.as_tensor(prompt[1:], dtype=torch.long)
    return [None, *positions(logits[: len(prompt) - 1], following, alternatives)]


def all_logits(seq: "Sequence") -> bool:
    """Whether ``seq``'s prefill keeps the logits of every prompt position, not only the last."""
    return seq.request.return_context_logits or seq.request.prompt_logprobs is not None


def keep_prompt(seq: "Sequence", logits: torch.Tensor) -> None:
    """What ``seq`` asked of its prompt's logits ([prompt, vocab]): the logits themselves, the prompt's log-probs."""
    if seq.request.return_context_logits:
        seq.context_logits = logits.float().cpu().numpy()
    if seq.request.prompt_logprobs is not None:
        seq.prompt_top = prompt_positions(logits, seq.tokens, seq.request.prompt_logprobs)


def chosen(logits: torch.Tensor | None, rows: list["Sequence"], tokens: list[int]) -> dict[int, Position]:
    """Row index → the position of the token chosen for it, for the rows that ask (``top_logprobs``); ``logits``
    None (a step launched ahead, which no such row joins): none."""
    asked = [i for i, s in enumerate(rows) if s.request.top_logprobs is not None]
    if logits is None or not asked:
        return {}
    index = torch.tensor(asked, device=logits.device)
    found = positions(logits.index_select(0, index), torch.tensor([tokens[i] for i in asked]),
                      max(rows[i].request.top_logprobs for i in asked))
    return {i: position[:1 + rows[i].request.top_logprobs] for i, position in zip(asked, found)}
