"""The python target's sampler draws each sampled row's token from its processed, filtered distribution with the
row's own generator (no model, no Triton)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from forge.in_triton.python_target.forge_decoder import sampling  # noqa: E402
from forge.in_triton.python_target.forge_decoder.request import GenerationRequest, SamplingParams  # noqa: E402

DRAWS = 6000


def _row(seed: int, **params):
    request = GenerationRequest([1, 2, 3], 8, sampling=SamplingParams(**params))
    generator = None if request.sampling.greedy else torch.Generator().manual_seed(seed)
    return SimpleNamespace(request=request, tokens=[1, 2, 3], generated=0, generator=generator,
                           top_p=request.sampling.top_p, bias=None, matcher=None)


def _frequencies(logits: torch.Tensor, **params) -> torch.Tensor:
    """How often each token is drawn over DRAWS steps of 8 rows sampled together (each its own generator)."""
    rows = [_row(seed, **params) for seed in range(8)]
    counts = torch.zeros(logits.shape[-1])
    for _ in range(DRAWS // len(rows)):
        chosen, _ = sampling.choose(logits.expand(len(rows), -1), rows)
        counts += torch.bincount(torch.tensor(chosen), minlength=logits.shape[-1])
    return counts / counts.sum()


def _assert_close(observed: torch.Tensor, expected: torch.Tensor) -> None:
    """Each frequency within 5 standard errors of its probability; impossible tokens never drawn."""
    assert observed[expected == 0].sum() == 0, observed
    bound = 5 * torch.sqrt(expected * (1 - expected) / DRAWS) + 1e-9
    assert ((observed - expected).abs() <= bound).all(), (observed, expected)


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf"), 1.5, -0.5])


def test_temperature_one_draws_the_softmax():
    _assert_close(_frequencies(LOGITS, temperature=1.0, top_p=1.0), torch.softmax(LOGITS, -1))


def test_temperature_scales_before_the_draw():
    _assert_close(_frequencies(LOGITS, temperature=0.5, top_p=1.0), torch.softmax(LOGITS / 0.5, -1))


def test_top_k_and_top_p_leave_the_tail_out():
    top3 = torch.softmax(torch.where(LOGITS >= 1.0, LOGITS, torch.tensor(-math.inf)), -1)
    _assert_close(_frequencies(LOGITS, temperature=1.0, top_k=3, top_p=1.0), top3)
    probs = torch.softmax(LOGITS, -1)  # 0.41, 0.15, 0.09, 0.05, 0.02, 0, 0.25, 0.03: top_p 0.7 keeps 2.0, 1.5, 1.0
    kept = torch.zeros_like(probs)
    kept[[0, 6, 1]] = probs[[0, 6, 1]] / probs[[0, 6, 1]].sum()
    _assert_close(_frequencies(LOGITS, temperature=1.0, top_p=0.7), kept)


def test_a_seed_draws_the_same_tokens_whatever_rows_are_beside_it():
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0))
    alone = sampling.choose(logits[:1], [_row(7, temperature=1.0, top_p=1.0)])[0][0]
    rows = [_row(7, temperature=1.0, top_p=1.0), _row(1, temperature=0.0), _row(2, temperature=0.8, top_k=5),
            _row(3, temperature=1.0, top_p=0.9)]
    together, logprobs = sampling.choose(logits, rows)
    assert together[0] == alone
    assert together[1] == int(logits[1].argmax())  # the greedy row beside them
    assert logprobs[1] == pytest.approx(float(torch.log_softmax(logits[1], -1).max()), abs=1e-5)
    assert int(logits[2].topk(5).indices.eq(together[2]).sum()) == 1  # within its top 5
