"""Shadow's projection divides by costs the worker measured (speculation.worker.costs): c and v(K) from a stored
calibration, refreshed when stale; the server's step read from plain generations of two lengths (not from the
request's latency); medians, so one stall is not kept. Timings run on a fake clock: no wall-clock assert."""

from __future__ import annotations

import json
from datetime import timedelta

import httpx
import pytest
from django.conf import settings
from django.utils import timezone

from speculation.engine.projection import StepCosts
from speculation.worker import costs as worker_costs
from speculation.worker.shadow import measure_shadow

PROMPT, OUTPUT = [1, 5, 9, 14, 20], [20, 31, 7, 7, 42, 100, 3, 250, 7, 9]


@pytest.fixture
def shadow_policy(db, tiny_model_dir, settings):
    from fleet.models import Endpoint

    # the policy's own projection only: other candidates' replays (auto-pairing, tests/speculation/worker/
    # test_candidates.py) would calibrate their own costs too, wherever Redis happens to be up
    settings.CANDIDATE_REPLAYS_PER_MINUTE = 0
    from speculation.models import DraftModel, SpeculationPolicy

    endpoint = Endpoint.objects.create(
        name="tiny-shadow", base_url="http://127.0.0.1:9", node_class="cpu", served_model="tiny"
    )
    draft = DraftModel.objects.create(name="tiny-draft", kind="draft_model", path=str(tiny_model_dir))
    policy, _ = SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint, defaults={"mode": "shadow", "mechanism": "draft_model", "draft": draft, "k": 3}
    )
    return policy


def _shadow(policy, request_id: str) -> None:
    measure_shadow(
        endpoint_id=policy.endpoint_id,
        request_id=request_id,
        prompt_ids=PROMPT,
        output_ids=OUTPUT,
        finish_reason="length",
        max_tokens=len(OUTPUT),
        temperature=0.0,
        latency_ms=5000.0,  # a slow request: the projection must not read its latency as the target step
    )


MEASURED = StepCosts(target_step_s=0.010, draft_step_s=0.001, verify_s={1: 0.006, 4: 0.009, 9: 0.020})


def test_greedy_shadow_projects_with_the_measured_c_and_v_and_reuses_a_fresh_calibration(shadow_policy, monkeypatch):
    from speculation.models import CostCalibration, StageRecord

    calls = []
    monkeypatch.setattr(worker_costs, "measure", lambda **kw: calls.append(kw["path"]) or MEASURED)
    # when: two shadow measurements within the refresh interval
    _shadow(shadow_policy, "r1")
    _shadow(shadow_policy, "r2")
    # then: one calibration (remote: no target in the worker), used by both records
    assert calls == ["remote"]
    row = CostCalibration.objects.get()
    assert (row.node_class, row.path, row.draft_id) == ("cpu", "remote", shadow_policy.draft_id)
    record = StageRecord.objects.get(request_id="r2")
    k_mean = record.drafted_tokens / record.target_passes
    expected = record.mean_accepted_len / (MEASURED.v(k_mean) + k_mean * MEASURED.c)
    assert record.multiplier == pytest.approx(expected)
    assert f"c={MEASURED.c:.3f}" in record.reason and f"v={MEASURED.v(k_mean):.3f}" in record.reason


def test_a_stale_calibration_is_measured_again(shadow_policy, monkeypatch):
    from speculation.models import CostCalibration

    calls = []
    monkeypatch.setattr(worker_costs, "measure", lambda **kw: calls.append(1) or MEASURED)
    _shadow(shadow_policy, "r1")
    CostCalibration.objects.update(measured_at=timezone.now() - timedelta(seconds=settings.COST_REFRESH_S + 1))
    _shadow(shadow_policy, "r2")
    assert len(calls) == 2
    assert CostCalibration.objects.count() == 2


def test_without_costs_the_measurement_is_recorded_with_the_reason_and_no_projection(shadow_policy, monkeypatch):
    from speculation.models import StageRecord

    def fail(**kw):
        raise worker_costs.CalibrationError("timing the server's plain decode step failed: ConnectError")

    monkeypatch.setattr(worker_costs, "measure", fail)
    _shadow(shadow_policy, "r1")
    record = StageRecord.objects.get(request_id="r1")
    assert record.action == "would_speculate" and record.mean_accepted_len is not None
    assert record.multiplier is None and "no projection" in record.reason and "ConnectError" in record.reason


class FakeVllm:
    """Answers baseline generations and scoring calls in vLLM's shapes; each costs 30 ms + 10 ms per generated
    or scored token on the fake clock, and the third call stalls for two seconds."""

    def __init__(self) -> None:
        self.now, self.calls, self.bodies = 0.0, 0, []

    def perf_counter(self) -> float:
        return self.now

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.calls += 1
        self.bodies.append(body)
        self.now += 2.0 if self.calls == 3 else 0.0
        if body.get("prompt_logprobs"):  # a scoring call
            self.now += 0.030 + 0.001 * len(body["prompt"])
            entries = [None] + [{str(t): {"logprob": -0.1, "rank": 1}} for t in body["prompt"][1:]]
            return httpx.Response(200, json={"choices": [{"token_ids": [7], "prompt_logprobs": entries}]})
        self.now += 0.030 + 0.010 * body["max_tokens"]
        return httpx.Response(200, json={"usage": {"completion_tokens": body["max_tokens"]}, "choices": [{}]})


def test_remote_calibration_times_the_servers_decode_step_and_scoring_calls(shadow_policy, monkeypatch):
    from speculation.worker import generation

    fake = FakeVllm()
    client = httpx.Client(transport=httpx.MockTransport(fake.handle))
    monkeypatch.setattr(generation, "http", lambda: client)
    monkeypatch.setattr(worker_costs, "time", fake)
    monkeypatch.setattr("speculation.engine.costs.time", fake)
    endpoint = shadow_policy.endpoint
    # when
    costs = worker_costs.measure(endpoint=endpoint, policy=shadow_policy, path="remote", context=PROMPT)
    # then: (T(17) - T(1)) / 16 = 10 ms, overhead and the stall gone; verify(n) = 30 ms + 1 ms per token scored
    assert costs.target_step_s == pytest.approx(0.010)
    assert costs.verify_s == {
        n: pytest.approx(0.030 + 0.001 * (len(PROMPT) - 1 + n)) for n in worker_costs.VERIFY_SIZES
    }
    generations = [b for b in fake.bodies if not b.get("prompt_logprobs")]
    assert sorted({b["max_tokens"] for b in generations}) == [1, 1 + worker_costs.SERVER_STEP_TOKENS]
    assert all(b["prompt"] == PROMPT and b["ignore_eos"] for b in generations)


def test_local_calibration_times_the_target_loaded_in_the_worker(shadow_policy, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(worker_costs, "server_step_seconds", lambda **kw: 0.010)
    shadow_policy.target_path = str(tiny_model_dir)
    costs = worker_costs.measure(endpoint=shadow_policy.endpoint, policy=shadow_policy, path="local", context=PROMPT)
    assert set(costs.verify_s) == set(worker_costs.VERIFY_SIZES)
    assert all(s > 0 for s in costs.verify_s.values()) and costs.draft_step_s > 0
