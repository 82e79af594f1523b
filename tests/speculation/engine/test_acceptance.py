"""Expected acceptance sum_x min(p, q) with both distributions processed as the request asks.

Exact from logits; from a server's top-N log-probabilities exact when 0 < top_k < N, otherwise a lower bound
that never exceeds the exact value and accounts for the rest as unseen mass.
"""

from __future__ import annotations

import pytest
import torch

from speculation.engine import SamplingParams, probs_from_logits
from speculation.engine.acceptance import (
    expected_acceptance_exact,
    expected_acceptance_from_top,
    target_from_top_logprobs,
)


def _top(logits: torch.Tensor, n: int) -> dict[int, float]:
    """What a server returns: the n most likely tokens with their raw (temperature 1) log-probabilities."""
    logprobs = torch.log_softmax(logits.double(), -1)
    values, ids = logprobs.topk(n)
    return {int(t): float(v) for t, v in zip(ids, values, strict=True)}


def test_exact_acceptance_is_the_sum_of_minima_on_a_hand_case():
    # given two distributions over 3 tokens
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.2, 0.6]])
    # then sum_x min(p, q) = 0.2 + 0.2 + 0.2
    assert expected_acceptance_exact(p, q).tolist() == pytest.approx([0.6])


def test_processing_changes_the_acceptance_as_the_request_asks():
    # given logits where temperature and top-p matter
    target = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    draft = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    plain = SamplingParams(temperature=1.0)
    cold = SamplingParams(temperature=0.7, top_p=0.9)
    a_plain = expected_acceptance_exact(probs_from_logits(target, plain), probs_from_logits(draft, plain))
    a_cold = expected_acceptance_exact(probs_from_logits(target, cold), probs_from_logits(draft, cold))
    # then: the hand formula on the processed distributions, and not the same number
    p = probs_from_logits(target, cold)[0]
    q = probs_from_logits(draft, cold)[0]
    assert a_cold.item() == pytest.approx(sum(min(a, b) for a, b in zip(p.tolist(), q.tolist(), strict=True)))
    assert abs(a_cold.item() - a_plain.item()) > 0.01


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_k=5), SamplingParams(0.7, 5, 0.9)])
def test_top_k_below_n_gives_the_exact_processed_distribution(params):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, generator=generator) * 2
    bound = target_from_top_logprobs(_top(logits, 8), params, 64)
    assert bound.exact and bound.unseen == 0.0
    torch.testing.assert_close(bound.p, probs_from_logits(logits, params), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.5, top_p=0.95),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
    ],
)
def test_from_top_n_the_acceptance_is_a_lower_bound_with_the_unseen_mass(params):
    # given 20 positions of random target and draft logits over 64 tokens; the server returns the top 8
    generator = torch.Generator().manual_seed(1)
    target = torch.randn(20, 64, generator=generator) * 2.5
    draft = target + torch.randn(20, 64, generator=generator)
    q = probs_from_logits(draft, params)
    exact = expected_acceptance_exact(probs_from_logits(target, params), q)
    # when
    lower, unseen, all_exact = expected_acceptance_from_top([_top(row, 8) for row in target], q, params)
    # then: never above the exact value, and within the unseen mass of it (min(p, q) <= p per token)
    assert not all_exact
    assert (lower <= exact + 1e-6).all()
    assert (exact <= lower + unseen + 1e-6).all()
    assert (unseen >= 0).all() and (unseen < 1).all()
    assert lower.mean() > 0.5 * exact.mean()  # and informative: top-8 of 64 tokens sees most of the mass


def test_temperature_one_without_truncation_bounds_by_the_true_probabilities():
    # at temperature 1 the returned log-probabilities are the distribution itself: p(x) is exact per seen token
    logits = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 2
    bound = target_from_top_logprobs(_top(logits, 8), SamplingParams(temperature=1.0), 64)
    top = torch.softmax(logits, -1).topk(8)
    torch.testing.assert_close(bound.p[top.indices], top.values, atol=1e-6, rtol=0)
    assert bound.unseen == pytest.approx(1.0 - top.values.sum().item(), abs=1e-6)
