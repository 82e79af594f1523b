"""Measured step costs: the timings are repeated and the fastest repeat kept, the target and draft stay usable,
and the projection divides by c and v(K) exactly as the lookahead controller does.

No wall-clock assert: the timing functions read `time.perf_counter` through the module, and these tests replace
it with a clock the fake target / proposer advance by a known amount."""

from __future__ import annotations

import pytest
import torch

from speculation.engine import DraftModelProposer, DynamicLookahead, LocalTarget, generate_plain
from speculation.engine import costs as engine_costs
from speculation.engine.projection import StepCosts, expected_tokens, project, verify_cost
from speculation.engine.proposers import Proposal
from speculation.engine.request import GenerationConfig
from speculation.engine.target import TargetOutput


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(engine_costs, "time", fake)
    return fake


class ClockedTarget:
    """A verification of n tokens costs 10 ms + 1 ms per token; the calls in `stalled` take a second more (another
    process on the cores)."""

    vocab_size, max_context, device = 8, 1 << 20, torch.device("cpu")

    def __init__(self, clock: FakeClock, stalled: set[int]) -> None:
        self.clock, self.stalled, self.calls, self.length = clock, stalled, 0, 0

    def prefill(self, prompt_ids: list[int]) -> None:
        self.length = len(prompt_ids) - 1

    def forward(self, tokens: torch.Tensor, *, return_hidden: bool = False) -> TargetOutput:
        self.calls += 1
        self.clock.now += 0.010 + 0.001 * tokens.shape[0] + (1.0 if self.calls in self.stalled else 0.0)
        self.length += tokens.shape[0]
        return TargetOutput(logits=torch.zeros(tokens.shape[0], self.vocab_size), hidden=None)

    def rollback(self, length: int) -> None:
        self.length = length


def test_verify_timing_keeps_the_fastest_repeat_even_when_most_repeats_were_slowed(clock):
    target = ClockedTarget(clock, stalled=set(range(1, 10)))  # the first 3 of 5 rounds over 3 sizes: a median stalls
    measured = engine_costs.time_verify(target, [1, 2, 3, 4], [1, 4, 9], repeats=5)

    assert target.calls == 15  # every size, every repeat
    assert target.length == 3  # rolled back to the context after each timing
    assert measured == {n: pytest.approx(0.010 + 0.001 * n) for n in (1, 4, 9)}


class ClockedProposer:
    wants_hidden = False

    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.calls, self.verified = clock, 0, []

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, committed: list[int], k: int, params, generator) -> Proposal:
        self.calls += 1
        self.clock.now += 0.002 * k + (5.0 if self.calls == 2 else 0.0)  # the first timed proposal stalls
        return Proposal(tokens=torch.zeros(k, dtype=torch.long), q=None)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        self.verified.append((num_accepted, num_drafted))

    def observe_target(self, hidden, num_accepted: int) -> None:
        pass


def test_a_size_measured_cheaper_than_a_smaller_one_is_pooled_with_it():
    measured = {1: 0.27, 2: 1.34, 3: 0.79, 5: 0.93, 9: 1.50}  # verify(2) was slowed in every repeat
    pooled = engine_costs.non_decreasing(measured)
    assert list(pooled.values()) == sorted(pooled.values())
    assert pooled[1] == 0.27 and pooled[9] == 1.50
    assert pooled[2] == pooled[3] == pooled[5] == pytest.approx((1.34 + 0.79 + 0.93) / 3)
    assert engine_costs.non_decreasing({1: 0.1, 4: 0.2}) == {1: 0.1, 4: 0.2}  # already ordered: unchanged


def test_draft_step_timing_is_the_fastest_repeat_per_drafted_token(clock):
    proposer = ClockedProposer(clock)
    step = engine_costs.time_draft_step(proposer, [5, 6, 7], steps=8, repeats=5)

    assert step == pytest.approx(0.002)
    assert proposer.calls == 6  # a warm-up proposal, then the repeats
    assert proposer.verified[1:] == [(0, 8)] * 5  # every proposal rejected: the draft's cache rolls back


def test_timing_a_real_target_and_draft_leaves_both_usable(target_model, draft_model):
    context = [3, 1, 4, 1, 5, 9, 2, 6]
    target = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=12, k=1)
    before = generate_plain(target, context, config).tokens

    verify = engine_costs.time_verify(target, context, [1, 6], repeats=3)
    draft = engine_costs.time_draft_step(DraftModelProposer(draft_model, target_vocab_size=48), context, repeats=3)

    assert set(verify) == {1, 6} and all(s > 0 for s in verify.values()) and draft > 0
    assert generate_plain(target, context, config).tokens == before


def test_step_costs_divide_by_the_target_step_and_interpolate_verify_cost_like_the_controller():
    costs = StepCosts(target_step_s=0.010, draft_step_s=0.002, verify_s={1: 0.004, 3: 0.006, 9: 0.018})

    assert costs.c == pytest.approx(0.2)
    assert costs.v(2) == pytest.approx(0.6)  # 3 tokens: measured
    assert costs.v(4) == pytest.approx(1.0)  # 5 tokens: a third of the way from 3 (6 ms) to 9 (18 ms)
    lookahead = DynamicLookahead(verify_s=dict(costs.verify_s))
    assert lookahead.verify_cost(5) == verify_cost(costs.verify_s, 5)
    tokens = expected_tokens(alpha=0.8, k=4)
    assert costs.multiplier(tokens_per_step=tokens, k=4) == pytest.approx(tokens / (1.0 + 4 * 0.2))


def test_a_verify_cost_growing_with_k_moves_the_best_k_below_the_constant_v_optimum():
    flat = project(alpha=0.8, c=0.05, v=1.0)
    costs = StepCosts(target_step_s=0.010, draft_step_s=0.0005, verify_s={1: 0.010, 2: 0.011, 9: 0.040})
    growing = costs.curve(alpha=0.8)

    best_flat = next(p.k for p in flat if p.best)
    best_growing = next(p.k for p in growing if p.best)
    assert best_growing < best_flat
    assert growing[0].multiplier == pytest.approx(expected_tokens(alpha=0.8, k=1) / (costs.v(1) + costs.c))


def test_costs_without_a_target_step_or_verify_sizes_are_refused():
    with pytest.raises(ValueError):
        StepCosts(target_step_s=0.0, draft_step_s=0.001, verify_s={1: 0.01})
    with pytest.raises(ValueError):
        StepCosts(target_step_s=0.01, draft_step_s=0.001, verify_s={})
