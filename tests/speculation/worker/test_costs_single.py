"""The single-stream local path is timed as prod runs it (speculation.worker.step_timing, costs._single_step_costs):
steps of the engine's own step with prod's proposer, each step's relay before the next counted in the step, and the
typical round kept, not the fastest. Timings of the relay use a sleep that any step must contain: no other
wall-clock assert."""

from __future__ import annotations

import time

import pytest

from speculation.engine import DraftModelProposer, LocalTarget, load_causal_lm
from speculation.worker import costs as worker_costs
from speculation.worker.step_timing import STEPS_PER_SIZE, SingleStepTimer, waited

CONTEXT = [1, 5, 9, 14, 20, 31]
RELAY_S = 0.02


def test_it_times_the_loops_steps_at_each_size_with_the_relay_inside_each_step(tiny_model_dir):
    # given: prod's loop over the tiny pair, and a relay that takes RELAY_S per step (the matcher and the send)
    model = load_causal_lm(str(tiny_model_dir))
    relayed = []
    timer = SingleStepTimer(
        LocalTarget(model),
        DraftModelProposer(model, target_vocab_size=model.vocab_size),
        context=CONTEXT,
        relay=lambda ids: relayed.append(ids) or time.sleep(RELAY_S),
    )
    # when: one round over four sizes (after the warm-up round the first call runs)
    verify, drafts = timer.round((1, 2, 4, 9))
    # then: every size ran its steps after the first, each step's time beside drafting holds its relay
    assert sorted(verify) == [1, 2, 4, 9]
    assert all(len(steps) == STEPS_PER_SIZE - 1 for steps in verify.values())
    assert min(s for steps in verify.values() for s in steps) >= RELAY_S
    assert len(drafts) == 3 * (STEPS_PER_SIZE - 1) and all(0 < d < RELAY_S for d in drafts)
    assert relayed and all(relayed)  # each step's committed tokens, before the next step


def test_a_step_relay_is_waited_for_before_the_next_step():
    class Relay:  # StepRelay's interface: put hands the ids to its thread, relayed counts the steps done
        relayed = 0

        def put(self, ids):
            import threading

            def later():
                time.sleep(RELAY_S)
                self.relayed += 1

            threading.Thread(target=later).start()

    started = time.perf_counter()
    waited(Relay())([7, 8])
    assert time.perf_counter() - started >= RELAY_S


@pytest.fixture
def eagle_policy(db, tiny_model_dir, tmp_path, settings, monkeypatch):
    import torch

    from fleet.models import Endpoint
    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights
    from speculation.models import DraftModel, SpeculationPolicy

    settings.PROD_BATCH_SLOTS = 8  # batching on: an EAGLE head is still served single-stream
    monkeypatch.setattr(worker_costs, "_wait_until_server_idle", lambda endpoint, *, deadline: True)
    monkeypatch.setattr(worker_costs.cpuload, "wait_until_quiet", lambda **kw: True)
    monkeypatch.setattr(worker_costs, "server_step_seconds", lambda **kw: 0.010)
    head = EagleHead(EagleConfig.for_target(tiny_model_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "head")
    endpoint = Endpoint.objects.create(name="tiny-eagle", base_url="http://127.0.0.1:9", served_model="tiny")
    draft = DraftModel.objects.create(name="tiny-head", kind="eagle_head", path=str(tmp_path / "head"))
    return SpeculationPolicy(
        endpoint=endpoint, mechanism="eagle_head", draft=draft, k=3, target_path=str(tiny_model_dir)
    )


def test_a_single_stream_eagle_calibration_keeps_the_typical_round_with_the_relay_not_the_fastest(
    eagle_policy, monkeypatch
):
    # given: rounds of prod's single-stream steps whose times spread (the fastest 1 ms, the typical 3 ms)
    rounds = iter([(1, 0.1), (5, 0.5), (3, 0.3), (4, 0.4), (2, 0.2), (3, 0.3)])
    built = []

    class Timer:
        def __init__(self, target, proposer, *, context, relay):
            built.append((type(target).__name__, type(proposer).__name__, relay))

        def round(self, sizes):
            ms, draft_ms = next(rounds)
            return {n: [ms / 1000 * n] for n in sizes}, [draft_ms / 1000]

    monkeypatch.setattr(worker_costs, "SingleStepTimer", Timer)
    monkeypatch.setattr(worker_costs, "time_verify", lambda *a, **kw: pytest.fail("forwards timed alone"))
    monkeypatch.setattr(worker_costs, "time_draft_step", lambda *a, **kw: pytest.fail("draft timed alone"))
    # when
    costs = worker_costs.measure(endpoint=eagle_policy.endpoint, policy=eagle_policy, path="local", context=CONTEXT)
    # then: prod's own target and EAGLE proposer, with a relay; the median of the rounds, not their fastest
    assert built == [("LocalTarget", "EagleProposer", built[0][2])] and built[0][2] is not None
    assert costs.verify_s == {n: pytest.approx(0.003 * n) for n in worker_costs.VERIFY_SIZES}
    assert costs.draft_step_s == pytest.approx(0.0003)


def test_a_draft_tree_keeps_its_forwards_timed_alone(eagle_policy, monkeypatch):
    # given: the same head drafting EAGLE-2 trees (a step's size is its nodes, not K)
    eagle_policy.eagle_tree = {"depth": 3, "top_k": 2, "nodes": 6}
    monkeypatch.setattr(worker_costs, "SingleStepTimer", lambda *a, **kw: pytest.fail("a tree timed as a chain"))
    # when
    costs = worker_costs.measure(endpoint=eagle_policy.endpoint, policy=eagle_policy, path="local", context=CONTEXT)
    # then
    assert set(costs.verify_s) == set(worker_costs.VERIFY_SIZES) and costs.draft_step_s > 0
