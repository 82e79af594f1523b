"""Dynamic K maximises E[N] / (verify(K+1) + K * draft_step) from measured costs, and backs off to K = 0."""

from __future__ import annotations

import pytest

from speculation.engine import DynamicLookahead, expected_tokens
from speculation.engine.lookahead import PROBE_EVERY, StepReport


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
        lookahead.observe(StepReport(drafted=0, accepted=0, reached=0, draft_s=0.0, verify_s=1.0))
    assert lookahead.choose() == 1


def test_verify_cost_that_jumps_with_size_keeps_k_below_the_jump():
    # a CPU matrix kernel: up to 4 rows cost one row, 6 rows cost twice as much
    lookahead = measured(0.8, {1: 1.0, 4: 1.0, 6: 2.0, 9: 3.0}, draft_step=0.1)
    assert lookahead.choose() == 3


def test_a_size_measured_dearer_than_a_larger_one_is_pooled_with_it():
    # given: verifying 5 tokens looked dearer than verifying 6 (noise: the demo measured 16 vs 13 ms)
    lookahead = measured(0.975, {1: 6.5, 2: 6.5, 3: 9.3, 4: 16.5, 5: 10.6, 6: 13.2}, draft_step=1.2)
    lookahead.k_max = 5
    # then: the sizes out of order count as their mean (4 and 5, then 6 too, which is below that mean), so
    # K = 5 (6 tokens) is not ruled out by 5 tokens' dear look
    pooled = (16.5 + 10.6 + 13.2) / 3
    assert [lookahead.verify_cost(n) for n in (4, 5, 6)] == pytest.approx([pooled] * 3)
    assert lookahead.choose() == 5


def test_one_stalled_step_moves_a_cost_by_at_most_spike_times_its_weight():
    from speculation.engine.lookahead import DECAY, SPIKE

    lookahead = measured(0.9, {1: 1.0, 6: 1.2}, draft_step=0.05)  # each set value counts as one measurement
    lookahead.k_max = 5
    lookahead.observe(StepReport(drafted=5, accepted=5, reached=5, draft_s=5 * 0.05, verify_s=100.0))  # a 100 s stall
    assert lookahead.verify_s[6] == pytest.approx((1.2 + SPIKE * 1.2) / 2)  # the mean of two measurements
    lookahead.observe(StepReport(drafted=5, accepted=5, reached=5, draft_s=100.0, verify_s=1.2))
    assert lookahead.draft_step_s == pytest.approx((0.05 + 0.05 + SPIKE * 0.05) / 3)
    assert lookahead.choose() == 5  # still speculating
    for _ in range(20):  # past 1 / (1 - DECAY) measurements: the decayed average
        lookahead.observe(StepReport(drafted=5, accepted=5, reached=5, draft_s=5 * 0.05, verify_s=1.2))
    before = lookahead.verify_s[6]
    lookahead.observe(StepReport(drafted=5, accepted=5, reached=5, draft_s=5 * 0.05, verify_s=100.0))
    assert lookahead.verify_s[6] == pytest.approx(DECAY * before + (1 - DECAY) * SPIKE * before)


def test_a_sizes_first_measurement_is_a_warm_up_the_next_one_replaces():
    lookahead = DynamicLookahead(k_max=5, k_start=5)
    lookahead.observe(
        StepReport(drafted=5, accepted=5, reached=5, draft_s=0.05, verify_s=0.030)
    )  # the first step: cold
    assert lookahead.choose() == 5  # measured again before anything is decided on it
    lookahead.observe(StepReport(drafted=5, accepted=5, reached=5, draft_s=0.05, verify_s=0.010))
    assert lookahead.verify_s[6] == pytest.approx(0.010)
    lookahead.observe(StepReport(drafted=5, accepted=5, reached=5, draft_s=0.05, verify_s=0.014))
    assert lookahead.verify_s[6] == pytest.approx(0.012)  # then the mean while they are few


def test_every_controller_takes_the_same_choose_and_observe():
    # given each K controller, driven only through the Lookahead interface
    from speculation.engine import LoadAwareLookahead, TreeLookahead
    from speculation.engine.tree import TreeShape

    controllers = [
        DynamicLookahead(k_max=4, k_start=4),
        TreeLookahead.for_tree(TreeShape(top_k=2, depth=4, nodes=6), k_max=4, k_start=4),
        LoadAwareLookahead(k_start=4, k_max=4),
    ]
    for lookahead in controllers:
        chosen = []
        for _ in range(40):  # a draft that is always right, verification nearly free at any width
            k = lookahead.choose(1)
            chosen.append(k)
            report = StepReport(drafted=k, accepted=k, reached=k, draft_s=0.001 * k, verify_s=0.01 + 0.0001 * k)
            lookahead.observe(report)
        # then each settles on drafting (the step's tokens pay for its cost), within its cap
        assert 0 <= min(chosen) and max(chosen) <= 4, type(lookahead).__name__
        assert chosen[-1] > 0, type(lookahead).__name__
