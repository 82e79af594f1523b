"""Dynamic K maximises E[N] / (verify(K+1) + K * draft_step) from measured costs, and backs off to K = 0."""

from __future__ import annotations

import pytest

from speculation.engine import DynamicLookahead, expected_tokens
from speculation.engine.lookahead import PROBE_EVERY


def measured(alpha: float, verify: dict[int, float], draft_step: float) -> DynamicLookahead:
    lookahead = DynamicLookahead(k_max=8, k_start=5)
    lookahead.accepted, lookahead.reached = alpha * 1000, 1000.0
    lookahead.verify_s = dict(verify)
    lookahead.draft_step_s = draft_step
    return lookahead


def test_expected_tokens_matches_the_anchor_table():
    assert round(expected_tokens(alpha=0.7, k=5), 2) == 2.94
    assert round(expected_tokens(alpha=0.9, k=5), 2) == 4.69
    assert expected_tokens(alpha=1.0, k=5) == 6


def test_high_acceptance_and_flat_verify_cost_picks_a_long_lookahead():
    lookahead = measured(0.9, {1: 1.0, 9: 1.0}, draft_step=0.02)
    assert lookahead.choose() == 8


@pytest.mark.parametrize(("c", "best_k"), [(0.05, 6), (0.2, 3)])
def test_it_reproduces_the_anchor_optimum_with_v_equal_1(c, best_k):
    lookahead = measured(0.7, {1: 1.0, 9: 1.0}, draft_step=c)
    assert lookahead.choose() == best_k


def test_no_acceptance_backs_off_to_plain_steps_and_probes_later():
    lookahead = measured(0.0, {1: 1.0, 6: 1.2}, draft_step=0.1)
    assert lookahead.choose() == 0
    for _ in range(PROBE_EVERY):
        lookahead.observe(drafted=0, accepted=0, reached=0, draft_s=0.0, verify_s=1.0)
    assert lookahead.choose() == 1


def test_verify_cost_that_jumps_with_size_keeps_k_below_the_jump():
    # a CPU matrix kernel: up to 4 rows cost one row, 6 rows cost twice as much
    lookahead = measured(0.8, {1: 1.0, 4: 1.0, 6: 2.0, 9: 3.0}, draft_step=0.1)
    assert lookahead.choose() == 3
