"""Load-aware K: the lookahead that pays at the batch's current size, K = 0 (plain batched decoding) included."""

from __future__ import annotations

import pytest

from speculation.engine import LoadAwareLookahead
from speculation.engine.lookahead import REMEASURE_EVERY, StepReport, load_bucket


def measured(*, alpha: float, costs: dict[int, tuple[dict[int, float], float]]) -> LoadAwareLookahead:
    """A lookahead with these measurements: batch size -> ({tokens verified per slot: seconds}, draft step)."""
    lookahead = LoadAwareLookahead(k_start=5)
    lookahead.accepted, lookahead.reached = alpha * 1000, 1000.0
    for batch_size, (verify, draft_step) in costs.items():
        table = lookahead._costs(batch_size)
        table.verify_s, table.draft_step_s = dict(verify), draft_step
    return lookahead


def test_batch_sizes_share_measurements_by_power_of_two():
    assert [load_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_it_speculates_while_verifying_more_tokens_is_nearly_free_and_stops_when_it_costs_their_number():
    # given: one slot, verify cost flat in the tokens (memory-bound); 32 slots, verify cost proportional to
    # the tokens (compute-bound), at the same acceptance and relative draft cost
    lookahead = measured(
        alpha=0.8,
        costs={1: ({1: 1.0, 6: 1.1}, 0.05), 32: ({1: 1.0, 3: 3.0, 6: 6.0}, 0.05)},
    )
    # when / then
    assert lookahead.choose(1, k_max=8) >= 4
    assert lookahead.choose(32, k_max=8) == 0
    assert lookahead.choose(30, k_max=8) == 0  # 30 slots: the 32 bucket's measurements


def test_it_chooses_within_the_requests_k():
    lookahead = measured(alpha=0.95, costs={4: ({1: 1.0, 9: 1.0}, 0.01)})
    assert lookahead.choose(4, k_max=3) == 3


def test_acceptance_is_shared_by_every_batch_size():
    # given a flat verify cost at 8 slots, where a good draft pays
    lookahead = measured(alpha=0.9, costs={8: ({1: 1.0, 6: 1.05}, 0.1)})
    assert lookahead.choose(8, k_max=5) > 0
    # when steps at 1 slot see every draft rejected
    for _ in range(120):
        lookahead.observe(StepReport(batch_size=1, drafted=5, accepted=0, reached=1, draft_s=0.5, verify_s=1.0))
    # then the 8-slot choice backs off too
    assert lookahead.alpha < 0.05
    assert lookahead.choose(8, k_max=5) == 0


def test_greedy_and_sampled_slots_keep_their_own_acceptance_and_k():
    # given one slot's flat verify cost, where a draft that agrees pays
    lookahead = measured(alpha=0.6, costs={1: ({1: 1.0, 6: 1.1}, 0.05)})
    lookahead.sampled_accepted, lookahead.sampled_reached = 0.6 * 1000, 1000.0
    # when steps of sampled slots see their drafts rejected and greedy slots theirs accepted
    for _ in range(120):
        lookahead.observe(
            StepReport(
                batch_size=1,
                drafted=5,
                accepted=5,
                reached=5,
                sampled_accepted=0,
                sampled_reached=1,
                draft_s=0.25,
                verify_s=1.1,
            )
        )
    # then each kind has its own estimate and K, and choosing for the second kind does not count the step again
    assert lookahead.alpha > 0.95 and lookahead.sampled_alpha < 0.05
    steps = dict(lookahead.steps)
    assert lookahead.choose(1, k_max=5) > 0
    assert lookahead.choose(1, k_max=5, sampled=True, count=False) == 0
    assert lookahead.steps[1] == steps.get(1, 0) + 1


def test_fresh_batch_sizes_explore_before_they_choose():
    # the first steps at a new size measure, each twice (the first is its warm-up): k_start, a shorter K (verify
    # cost against K), then a plain step
    lookahead = LoadAwareLookahead(k_start=4)
    seen = []
    for _ in range(6):
        k = lookahead.choose(16, k_max=4)
        seen.append(k)
        lookahead.observe(
            StepReport(batch_size=16, drafted=k, accepted=k // 2, reached=k, draft_s=0.01 * k, verify_s=0.1)
        )
    assert seen == [4, 4, 2, 2, 0, 0]


def test_a_k_measured_at_a_bad_moment_is_measured_again():
    # given: verifying 6 tokens once looked very slow (a noisy moment), so plain steps win
    lookahead = measured(alpha=0.9, costs={1: ({1: 1.0, 3: 1.1, 6: 50.0}, 0.05)})
    choices = [lookahead.choose(1, k_max=5) for _ in range(REMEASURE_EVERY)]
    # then: within REMEASURE_EVERY steps K = k_start is drafted again, to be measured anew
    assert choices[-1] == 5 and 5 not in choices[:-1]


def test_a_step_that_catches_the_draft_up_does_not_count_as_a_draft_step():
    # given a measured draft step of 0.05 s
    lookahead = measured(alpha=0.9, costs={4: ({1: 1.0, 6: 1.1}, 0.05)})
    # when the first draft step after plain steps also feeds the draft 20 committed tokens (2 s)
    lookahead.observe(
        StepReport(batch_size=4, drafted=5, accepted=4, reached=5, draft_s=2.0, verify_s=1.1, catch_up=True)
    )
    # then the draft step estimate stands, and speculation still pays
    assert lookahead.by_load[4].draft_step_s == pytest.approx(0.05)
    assert lookahead.choose(4, k_max=5) > 0


def test_a_bucket_seeded_from_a_calibration_chooses_from_its_first_step():
    # given: load 1 seeded with stored costs where verifying up to 4 tokens costs a plain step's time
    lookahead = LoadAwareLookahead(k_start=5)
    assert lookahead.seed(1, verify_s={1: 1.0, 4: 1.0, 9: 5.0}, draft_step_s=0.01)
    lookahead.accepted, lookahead.reached = 0.9, 1.0
    # then: no learning steps (k_start, k_start // 2, plain): the best K for those costs at once
    assert [lookahead.choose(1, k_max=5) for _ in range(3)] == [3, 3, 3]
    # and a bucket that has measurements of its own is not overwritten
    lookahead.observe(StepReport(batch_size=1, drafted=3, accepted=3, reached=3, draft_s=0.03, verify_s=2.0))
    assert not lookahead.seed(1, verify_s={1: 9.0}, draft_step_s=9.0)
    assert lookahead.by_load[1].verify_s[4] == pytest.approx(1.5)  # the seed counted as one measurement


def test_a_hybrids_lookups_are_sized_by_their_own_acceptance_over_the_same_verify_costs():
    # given: lookups accepted at 0.9, the model's drafts at 0.5; one slot memory-bound, 32 slots compute-bound
    lookahead = measured(alpha=0.5, costs={1: ({1: 1.0, 9: 1.1}, 0.05), 32: ({1: 1.0, 3: 2.0, 9: 6.0}, 0.05)})
    for step in range(1, 3):  # past the step that re-measures k_start
        lookahead.steps[load_bucket(1)] = lookahead.steps[load_bucket(32)] = step
    lookahead.observe(
        StepReport(batch_size=1, drafted=0, accepted=0, reached=0, draft_s=0.0, verify_s=1.0, lookup=(900, 1000, 0, 0))
    )
    for bucket in (1, 32):
        lookahead._costs(bucket).seen.clear()  # the tables above count as measured
    # when / then: at one slot the whole lookup pays; at 32 slots verifying 9 costs 6 plain steps and a lookup of
    # 8 at 0.9 gives 6.1 tokens, one of 2 gives 2.7 for 2 steps: shorter ones pay better; the model's drafts at 0.5
    # do not pay there at all
    assert lookahead.choose_lookup(1, k_max=8) == 8
    at_load = lookahead.choose_lookup(32, k_max=8)
    assert 0 < at_load < 8
    assert lookahead.choose(32, k_max=8) == 0
    # sampled lookups keep their own estimate (the prior, 0.6 here): no longer than the greedy ones
    assert lookahead.choose_lookup(32, k_max=8, sampled=True) <= at_load


def test_a_hybrids_lookups_are_never_shorter_than_the_models_k_and_no_wider_while_costs_are_unknown():
    lookahead = measured(alpha=0.5, costs={32: ({1: 1.0, 3: 2.0, 9: 6.0}, 0.05)})
    lookahead.steps[load_bucket(32)] = lookahead.steps[load_bucket(8)] = 1  # not a re-measuring step
    lookahead._costs(32).seen.clear()
    lookahead.lookup_accepted, lookahead.lookup_reached = 900.0, 1000.0
    # the model's rows verify K + 1 = 5 wide this step: a lookup as long costs nothing more
    assert lookahead.choose_lookup(32, k_max=8, model_k=4) == 4
    assert lookahead.choose_lookup(32, k_max=8, model_k=1) == 2  # the costs' own choice (as above)
    # at a load with no costs measured yet, no wider than the model's K (whose sizes are being measured)
    assert lookahead.choose_lookup(8, k_max=8, model_k=3) == 3
    assert lookahead.choose_lookup(8, k_max=8, model_k=0) == 0


def test_a_size_wider_than_the_models_k_is_data_not_a_size_to_measure_again():
    # given: a load whose table holds a lookup's width 9, measured once (cold), beside warm plain and K = 2 sizes
    lookahead = measured(alpha=0.3, costs={8: ({1: 1.0, 3: 2.9, 9: 8.0}, 0.3)})
    table = lookahead._costs(8)
    table.seen.clear()
    table.seen[("verify", 9)] = 0  # measured once: its warm-up
    lookahead.steps[load_bucket(8)] = 1
    # when / then: the model's K (at most 3) is chosen from the costs (plain at this acceptance), not held at 3 to
    # re-measure a width it cannot reach; and the table counts as settled for the lookups
    assert lookahead.choose(8, k_max=3) == 0
    assert not table.exploring()
    # while a size within reach is cold, the controller measures it, and the lookups stay within its K
    table.seen[("verify", 3)] = 0
    assert table.exploring() and lookahead.choose(8, k_max=3) == 2
    assert lookahead.choose_lookup(8, k_max=8, model_k=2) == 2
