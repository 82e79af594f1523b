"""Shadow's projection divides by costs a worker measured (speculation.worker.costs): c and v(K) from the newest
stored calibration. The calibration never runs inside the shadow task: a stale or missing one is queued on the node
class's background queue (real Redis: the broker's own list), measured once however often it was queued, and a
record made before the first one is projected when it is stored. The server's step is read from plain generations
of two lengths (not from the request's latency), a median, so one stall is not kept. Timings run on a fake clock:
no wall-clock assert."""

from __future__ import annotations

import base64
import json
import os
from datetime import timedelta

import httpx
import pytest
import redis
from django.conf import settings
from django.utils import timezone

from speculation.engine.projection import StepCosts
from speculation.worker import costs as worker_costs
from speculation.worker.shadow import measure_shadow
from tests.support.models import serves

PROMPT, OUTPUT = [1, 5, 9, 14, 20], [20, 31, 7, 7, 42, 100, 3, 250, 7, 9]
BACKGROUND = "gpu.cpu.background"


@pytest.fixture
def shadow_policy(db, tiny_model_dir, settings):
    from fleet.models import Endpoint

    # the policy's own projection only: other candidates' replays (auto-pairing, tests/speculation/worker/
    # test_candidates.py) are queued apart
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


@pytest.fixture
def broker(redis_server):
    """The test session's Redis, the background queue and this endpoint's calibration keys emptied."""
    client = redis.Redis.from_url(redis_server.url)
    for key in [BACKGROUND, *client.scan_iter("ace:calibration-*")]:
        client.delete(key)
    yield client
    client.close()


def _shadow(policy, request_id: str, output: list[int] = OUTPUT) -> None:
    measure_shadow(
        endpoint_id=policy.endpoint_id,
        request_id=request_id,
        prompt_ids=PROMPT,
        output_ids=output,
        finish_reason="length",
        max_tokens=len(output),
        temperature=0.0,
        latency_ms=5000.0,  # a slow request: the projection must not read its latency as the target step
    )


def _queued(client: redis.Redis) -> list[tuple[str, dict]]:
    """(task name, kwargs) of every message on the background queue (kombu's JSON envelope, base64 body)."""
    out = []
    for raw in client.lrange(BACKGROUND, 0, -1):
        message = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        out.append((message["headers"]["task"], kwargs))
    return out


MEASURED = StepCosts(target_step_s=0.010, draft_step_s=0.001, verify_s={1: 0.006, 4: 0.009, 9: 0.020})


def _store(policy, path: str = "remote", age_s: float = 0.0, costs: StepCosts = MEASURED):
    from speculation.models import CostCalibration
    from speculation.services.costs import record_calibration

    row = record_calibration(
        endpoint=policy.endpoint, draft=policy.draft, path=path, costs=costs, repeats=5, context_tokens=5
    )
    CostCalibration.objects.filter(pk=row.pk).update(measured_at=timezone.now() - timedelta(seconds=age_s))
    return row


def _no_inline_measurement(monkeypatch) -> None:
    def fail(**kwargs):
        raise AssertionError("the shadow task measured costs inline")

    monkeypatch.setattr(worker_costs, "measure", fail)


def test_greedy_shadow_projects_with_the_stored_c_and_v(shadow_policy, broker, monkeypatch):
    from speculation.models import StageRecord

    _store(shadow_policy)
    _no_inline_measurement(monkeypatch)
    # when: two shadow measurements within the refresh interval
    _shadow(shadow_policy, "r1")
    _shadow(shadow_policy, "r2")
    # then: both projected with the stored costs (remote: no target in the worker), nothing queued
    record = StageRecord.objects.get(request_id="r2")
    k_mean = record.drafted_tokens / record.target_passes
    expected = record.mean_accepted_len / (MEASURED.v(k_mean) + k_mean * MEASURED.c)
    assert record.multiplier == pytest.approx(expected)
    assert f"c={MEASURED.c:.3f}" in record.reason and f"v={MEASURED.v(k_mean):.3f}" in record.reason
    assert _queued(broker) == []


def test_a_stale_calibration_is_queued_on_the_background_queue_not_measured_in_the_shadow_task(
    shadow_policy, broker, monkeypatch
):
    from speculation.models import CostCalibration, StageRecord

    _store(shadow_policy, age_s=settings.COST_REFRESH_S + 1)
    _no_inline_measurement(monkeypatch)
    # when: two shadow measurements find the calibration stale
    _shadow(shadow_policy, "r1")
    _shadow(shadow_policy, "r2")
    # then: each is projected with the newest stored costs meanwhile, and one refresh is queued for both
    for request_id in ("r1", "r2"):
        record = StageRecord.objects.get(request_id=request_id)
        assert record.multiplier is not None and "older than" in record.reason
    queued = _queued(broker)
    assert [name for name, _ in queued] == ["speculation.tasks.calibrate_costs_task"]
    assert queued[0][1]["endpoint_id"] == shadow_policy.endpoint_id and queued[0][1]["path"] == "remote"
    assert queued[0][1]["draft_id"] == shadow_policy.draft_id and queued[0][1]["node_class"] == "cpu"
    assert CostCalibration.objects.count() == 1


def test_the_calibration_task_stores_one_calibration_even_if_queued_twice(shadow_policy, broker, monkeypatch):
    from speculation.models import CostCalibration
    from speculation.worker.tasks import calibrate_costs_task

    _store(shadow_policy, age_s=settings.COST_REFRESH_S + 1)
    _shadow(shadow_policy, "r1")
    [(_, job)] = _queued(broker)
    calls = []
    monkeypatch.setattr(worker_costs, "measure", lambda **kw: calls.append(kw["path"]) or MEASURED)
    # when: the same calibration runs twice (queued twice, e.g. by two workers' shadow tasks)
    calibrate_costs_task.apply(kwargs=job)
    calibrate_costs_task.apply(kwargs=job)
    # then: measured and stored once; the second found the first's row fresh
    assert calls == ["remote"]
    assert CostCalibration.objects.count() == 2  # the stale one and one new


def test_a_calibration_gives_way_to_a_prod_job_that_arrives_while_it_times(shadow_policy, broker, monkeypatch):
    from speculation.models import CostCalibration
    from speculation.worker.tasks import calibrate_costs_task

    _store(shadow_policy, age_s=settings.COST_REFRESH_S + 1)
    _shadow(shadow_policy, "r1")
    [(_, job)] = _queued(broker)
    broker.delete(BACKGROUND, "gpu.cpu")
    timings = []

    def draft_step_while_a_prod_job_arrives(proposer, context, repeats=1):
        timings.append(len(context))
        broker.rpush("gpu.cpu", b"{}")  # a prod job lands on the node class's queue during the first timing
        return 0.001

    monkeypatch.setattr(worker_costs, "time_draft_step", draft_step_while_a_prod_job_arrives)
    try:
        # when: the queued calibration runs (no foreground job waits when it starts)
        calibrate_costs_task.apply(kwargs=job)
    finally:
        broker.delete("gpu.cpu")
    # then: it stopped before its second timing, stored nothing, released its lock, and is queued again
    assert len(timings) == 1
    assert CostCalibration.objects.count() == 1  # the stale one only
    key = worker_costs.cost_key(endpoint=shadow_policy.endpoint, policy=shadow_policy)
    assert broker.get(key.redis_key("lock")) is None
    [(name, requeued)] = _queued(broker)
    assert name == "speculation.tasks.calibrate_costs_task" and requeued["defers"] == 1


def test_background_work_waits_while_prod_jobs_run_on_the_node_class_not_only_while_they_queue(
    shadow_policy, broker, monkeypatch
):
    import time

    from speculation.jobs.admission import inflight_key, single_inflight_key
    from speculation.models import CostCalibration
    from speculation.worker.tasks import _foreground_waiting, calibrate_costs_task

    _store(shadow_policy, age_s=settings.COST_REFRESH_S + 1)
    _shadow(shadow_policy, "r1")
    [(_, job)] = _queued(broker)
    broker.delete(BACKGROUND, "gpu.cpu")
    monkeypatch.setattr(worker_costs, "measure", lambda **kw: MEASURED)
    now = time.time()
    try:
        # a prod job a batching worker took off the queue at once: admitted and in flight, the queue empty
        broker.zadd(inflight_key("cpu"), {"prod-1": now + 30})
        assert _foreground_waiting("cpu")
        # when: the calibration task starts then
        calibrate_costs_task.apply(kwargs=job)
        # then: it measured nothing and put itself back on the background queue
        assert CostCalibration.objects.count() == 1
        [(name, requeued)] = _queued(broker)
        assert name == "speculation.tasks.calibrate_costs_task" and requeued["defers"] == 1
        # a single-stream job counts too; a slot past its deadline (a dead worker) does not
        broker.delete(inflight_key("cpu"))
        broker.zadd(single_inflight_key("cpu"), {"prod-2": now + 30})
        assert _foreground_waiting("cpu")
        broker.zadd(single_inflight_key("cpu"), {"prod-2": now - 1})
        assert not _foreground_waiting("cpu")
        # and once nothing runs or waits, the task measures
        calibrate_costs_task.apply(kwargs={**requeued})
        assert CostCalibration.objects.count() == 2
    finally:
        broker.delete(inflight_key("cpu"), single_inflight_key("cpu"), BACKGROUND)


def test_a_calibration_another_worker_is_running_is_not_run_again(shadow_policy, broker, monkeypatch):
    from speculation.models import CostCalibration

    _no_inline_measurement(monkeypatch)
    key = worker_costs.cost_key(endpoint=shadow_policy.endpoint, policy=shadow_policy)
    broker.set(key.redis_key("lock"), "another-worker", ex=60)  # another worker holds the key's lock
    job = worker_costs.calibration_job(key, shadow_policy, PROMPT)
    # when
    assert worker_costs.calibrate(**job) is None
    # then
    assert CostCalibration.objects.count() == 0 and broker.get(key.redis_key("lock")) == b"another-worker"


def test_before_any_calibration_the_record_says_pending_and_is_projected_once_it_is_stored(
    shadow_policy, broker, monkeypatch
):
    from speculation.models import StageRecord
    from speculation.worker.tasks import calibrate_costs_task

    _no_inline_measurement(monkeypatch)
    _shadow(shadow_policy, "r1")
    record = StageRecord.objects.get(request_id="r1")
    assert record.multiplier is None and "calibration pending" in record.reason
    assert record.mean_accepted_len is not None  # the acceptance is recorded at once
    # when: the queued calibration runs
    [(_, job)] = _queued(broker)
    monkeypatch.setattr(worker_costs, "measure", lambda **kw: MEASURED)
    calibrate_costs_task.apply(kwargs=job)
    # then: the record gets the projection shadow would have made with it
    record.refresh_from_db()
    k_mean = record.drafted_tokens / record.target_passes
    assert record.multiplier == pytest.approx(record.mean_accepted_len / (MEASURED.v(k_mean) + k_mean * MEASURED.c))
    assert "pending" not in record.reason and f"c={MEASURED.c:.3f}" in record.reason
    assert record.tok_s == pytest.approx(record.baseline_tok_s * record.multiplier)


def test_a_failed_calibration_leaves_the_record_pending_and_lets_the_next_request_queue_it_again(
    shadow_policy, broker, monkeypatch
):
    from speculation.models import StageRecord
    from speculation.worker.tasks import calibrate_costs_task

    def fail(**kw):
        raise worker_costs.CalibrationError("timing the server's plain decode step failed: ConnectError")

    monkeypatch.setattr(worker_costs, "measure", fail)
    _shadow(shadow_policy, "r1")
    [(_, job)] = _queued(broker)
    broker.delete(BACKGROUND)
    calibrate_costs_task.apply(kwargs=job)  # logged as a warning, nothing stored
    _shadow(shadow_policy, "r2")
    assert StageRecord.objects.get(request_id="r1").multiplier is None
    assert [name for name, _ in _queued(broker)] == ["speculation.tasks.calibrate_costs_task"]


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
        if "prompt_logprobs" in body:  # a scoring call (None: only the greedy next token)
            self.now += 0.030 + 0.001 * len(body["prompt"])
            entries = [None] + [{str(t): {"logprob": -0.1, "rank": 1}} for t in body["prompt"][1:]]
            return httpx.Response(200, json={"choices": [{"token_ids": [7], "prompt_logprobs": entries}]})
        self.now += 0.030 + 0.010 * body["max_tokens"]
        return httpx.Response(200, json={"usage": {"completion_tokens": body["max_tokens"]}, "choices": [{}]})


def test_remote_calibration_times_the_servers_decode_step_and_scoring_calls(shadow_policy, monkeypatch):
    from speculation.worker import upstream

    fake = FakeVllm()
    client = httpx.Client(transport=httpx.MockTransport(fake.handle))
    monkeypatch.setattr(upstream, "http", lambda: client)
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
    generations = [b for b in fake.bodies if "prompt_logprobs" not in b]
    assert sorted({b["max_tokens"] for b in generations}) == [1, 1 + worker_costs.SERVER_STEP_TOKENS]
    assert all(b["prompt"] == PROMPT and b["ignore_eos"] for b in generations)


def test_local_calibration_times_the_target_loaded_in_the_worker(shadow_policy, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(worker_costs, "server_step_seconds", lambda **kw: 0.010)
    shadow_policy.target_path = str(tiny_model_dir)
    costs = worker_costs.measure(endpoint=shadow_policy.endpoint, policy=shadow_policy, path="local", context=PROMPT)
    assert set(costs.verify_s) == set(worker_costs.VERIFY_SIZES)
    assert all(s > 0 for s in costs.verify_s.values()) and costs.draft_step_s > 0


@pytest.mark.parametrize("slots", [8, 0])
def test_local_calibration_times_the_engine_prod_runs_the_request_on(
    shadow_policy, tiny_model_dir, monkeypatch, settings, slots
):
    # given: batching on (prod serves the local path in the batch loop) or off (the single-stream loop)
    settings.PROD_BATCH_SLOTS = slots
    monkeypatch.setattr(worker_costs, "server_step_seconds", lambda **kw: 0.010)
    timed = []
    monkeypatch.setattr(worker_costs, "time_verify", lambda target, *a, **kw: timed.append(target) or {1: 0.01})
    monkeypatch.setattr(worker_costs, "time_draft_step", lambda proposer, *a, **kw: timed.append(proposer) or 0.001)
    shadow_policy.target_path = str(tiny_model_dir)
    # when
    costs = worker_costs.measure(endpoint=shadow_policy.endpoint, policy=shadow_policy, path="local", context=PROMPT)
    # then: batching, the batch decoder's own steps at every size; else the single-stream loop's own steps (no
    # single-model timing either way)
    assert timed == []
    assert set(costs.verify_s) == set(worker_costs.VERIFY_SIZES)
    assert all(s > 0 for s in costs.verify_s.values()) and costs.draft_step_s > 0


@pytest.mark.parametrize("slots", [8, 0])
def test_the_workers_own_local_timings_wait_for_the_server_to_serve_nothing(
    shadow_policy, tiny_model_dir, monkeypatch, settings, slots
):
    from speculation.worker import upstream

    settings.PROD_BATCH_SLOTS = slots  # the batch decoder's steps are timed, or the single-stream engine's

    # given: a server that reports a running request on its first three polls, then none
    polls = []

    def metrics(request: httpx.Request) -> httpx.Response:
        polls.append(request.url.path)
        running = 1 if len(polls) <= 3 else 0
        return httpx.Response(200, text=f'vllm:num_requests_running{{model_name="tiny"}} {running}.0\n')

    client = httpx.Client(transport=httpx.MockTransport(metrics))
    monkeypatch.setattr(upstream, "http", lambda: client)
    monkeypatch.setattr(worker_costs, "QUIET_POLL_S", 0.0)
    monkeypatch.setattr(worker_costs, "server_step_seconds", lambda **kw: 0.010)
    started_after = []
    monkeypatch.setattr(worker_costs, "time_draft_step", lambda *a, **kw: started_after.append(len(polls)) or 0.001)
    monkeypatch.setattr(worker_costs, "time_verify", lambda *a, **kw: started_after.append(len(polls)) or {1: 0.01})

    class Timer:  # the batch decoder's steps: one round times every size and the draft step
        def __init__(self, *a, **kw):
            pass

        def round(self, sizes):
            started_after.append(len(polls))
            return {1: 0.01}, [0.001]

    class SingleTimer(Timer):  # the single-stream loop's steps: likewise, a list of steps per size
        def round(self, sizes):
            started_after.append(len(polls))
            return {1: [0.01]}, [0.001]

    monkeypatch.setattr(worker_costs, "BatchStepTimer", Timer)
    monkeypatch.setattr(worker_costs, "SingleStepTimer", SingleTimer)
    shadow_policy.target_path = str(tiny_model_dir)
    # when
    costs = worker_costs.measure(endpoint=shadow_policy.endpoint, policy=shadow_policy, path="local", context=PROMPT)
    # then: no timing round started before the server said it was idle, and each round asked again
    assert polls[0] == "/metrics" and started_after[0] == 4
    assert len(started_after) == worker_costs.REPEATS and started_after == sorted(started_after)
    assert costs.draft_step_s == 0.001 and costs.verify_s == {1: 0.01}


def test_the_workers_own_timings_also_wait_for_the_nodes_cores_to_be_quiet(shadow_policy, monkeypatch):
    from speculation.worker import cpuload

    # given: an idle server, and the node's other processes busy for two readings (vLLM's CPU build spins a core
    # after its gauge reads 0), then quiet
    monkeypatch.setattr(worker_costs, "_wait_until_server_idle", lambda endpoint, *, deadline: True)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # quiet: under half a core (a quarter of 2, at least 0.5)
    readings = iter([1.0, 0.9, 0.1] + [0.0] * 10)
    read = []
    monkeypatch.setattr(cpuload, "others_cores", lambda window_s=0.1: read.append(1) or next(readings))
    started_after = []
    # when: two timing rounds
    worker_costs._quietly(shadow_policy.endpoint, lambda: started_after.append(len(read)), quiet=True, rounds=2)
    # then: the first round started only after the quiet reading, the second after one more
    assert started_after == [3, 4]
    # on 64 cores a quarter of them may be busy with others: a spinning core no longer holds the timing up
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert worker_costs._quiet_cores() == 16.0
    # and a calibration that is not told to wait for quiet does not read the cores
    read.clear()
    worker_costs._quietly(shadow_policy.endpoint, lambda: None, quiet=False, rounds=2)
    assert read == []


def test_a_second_draft_borrows_the_servers_costs_and_times_only_its_own_draft_step(shadow_policy, monkeypatch):
    from speculation.models import DraftModel

    _store(shadow_policy)  # the policy's draft, fresh
    monkeypatch.setattr(worker_costs, "server_step_seconds", lambda **kw: pytest.fail("the server was timed again"))
    other = DraftModel.objects.create(name="tiny-draft-2", kind="draft_model", path=shadow_policy.draft.path)
    shadow_policy.draft = other
    costs = worker_costs.measure(endpoint=shadow_policy.endpoint, policy=shadow_policy, path="remote", context=PROMPT)
    assert costs.target_step_s == MEASURED.target_step_s and costs.verify_s == MEASURED.verify_s
    assert costs.draft_step_s > 0 and costs.draft_step_s != MEASURED.draft_step_s


def test_an_eagle_heads_draft_step_is_timed_on_the_target_in_the_worker(shadow_policy, tiny_model_dir, tmp_path):
    import torch

    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights
    from speculation.models import DraftModel

    head = EagleHead(EagleConfig.for_target(tiny_model_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "head")
    shadow_policy.mechanism = "eagle_head"
    shadow_policy.draft = DraftModel.objects.create(name="tiny-head", kind="eagle_head", path=str(tmp_path / "head"))
    shadow_policy.target_path = str(tiny_model_dir)
    proposer = worker_costs._draft_proposer(shadow_policy)
    # each timed proposal drafts (the loop's features for the committed token are fed in between), so a step costs
    assert worker_costs.time_draft_step(proposer, PROMPT) > 0
    shadow_policy.target_path = ""
    with pytest.raises(worker_costs.CalibrationError, match="target"):
        worker_costs._draft_proposer(shadow_policy)


# verifying up to 3 tokens costs one plain step's time; 4 and more cost 5x: the controller drafts K = 2
JUMP = StepCosts(target_step_s=0.010, draft_step_s=0.001, verify_s={1: 0.006, 2: 0.006, 3: 0.006, 4: 0.030, 9: 0.060})


def test_where_prod_chooses_k_per_step_shadow_projects_the_k_its_controller_would_choose(
    shadow_policy, broker, monkeypatch, tiny_model_dir, settings
):
    from speculation.engine import GenerationConfig, LocalTarget, generate, load_causal_lm
    from speculation.models import StageRecord
    from speculation.worker import shadow

    # given: prod would run the local path in the batch loop with its load-aware K (K up to 5), a stored calibration
    # whose verify cost jumps past 3 tokens, and an output the draft predicts throughout (draft = target)
    settings.PROD_BATCH_SLOTS, settings.PROD_BATCH_LOAD_AWARE_K = 8, True
    shadow_policy.path, shadow_policy.target_path, shadow_policy.k = "local", str(tiny_model_dir), 5
    shadow_policy.save()
    _store(shadow_policy, path="local", costs=JUMP)
    monkeypatch.setattr(shadow, "_CARRIED", {})
    _no_inline_measurement(monkeypatch)
    model = load_causal_lm(tiny_model_dir)
    output = generate(LocalTarget(model), None, PROMPT, GenerationConfig(max_new_tokens=10)).tokens
    # when
    _shadow(shadow_policy, "controller", output=output)
    # then: every drafting step drafted 2 (3 steps of 3 tokens), the last token a plain step, and S is the tokens
    # over those steps' modeled time: 10 x 10 ms / (3 x (6 + 2 x 1) + 6) ms, not the fixed K = 5's projection
    record = StageRecord.objects.get(request_id="controller")
    assert (record.drafted_tokens, record.target_passes, record.accepted_tokens) == (6, 4, 6)
    assert record.multiplier == pytest.approx(10 * 0.010 / (3 * (0.006 + 2 * 0.001) + 0.006))
    assert "load-aware controller" in record.reason and "mean K 1.50 of 5" in record.reason
    assert record.server_step_ms == pytest.approx(10.0)


def test_where_prod_drafts_the_policys_k_shadow_projects_that_k(shadow_policy, broker, monkeypatch, settings):
    from speculation.models import StageRecord

    # given: the same costs, but batching off (prod's single-stream loop drafts the policy's K every step)
    settings.PROD_BATCH_SLOTS = 0
    shadow_policy.k = 5
    shadow_policy.save()
    _store(shadow_policy, path="remote", costs=JUMP)
    _no_inline_measurement(monkeypatch)
    _shadow(shadow_policy, "fixed")
    # then: the replay drafted 5 a step (the last one cut at the output's end) and S is the fixed-K formula
    record = StageRecord.objects.get(request_id="fixed")
    assert "load-aware controller" not in record.reason
    assert record.drafted_tokens > 2 * (record.target_passes - 1)
    k_mean = record.drafted_tokens / record.target_passes
    assert record.multiplier == pytest.approx(record.mean_accepted_len / (JUMP.v(k_mean) + k_mean * JUMP.c))


def test_a_local_prod_request_carries_its_paths_stored_calibration_to_the_batch(shadow_policy, tiny_model_dir):
    from speculation.worker.generation import build

    serves(shadow_policy.endpoint, tiny_model_dir)  # target_path reproduces the served model
    shadow_policy.target_path = str(tiny_model_dir)
    assert build(shadow_policy.endpoint, shadow_policy, "local").costs is None  # nothing stored yet
    _store(shadow_policy, path="remote")
    assert build(shadow_policy.endpoint, shadow_policy, "local").costs is None  # another path's costs
    shadow_policy.path = "local"
    _store(shadow_policy, path="local", costs=JUMP)
    costs = build(shadow_policy.endpoint, shadow_policy, "local").costs
    assert costs is not None and costs.verify_s == pytest.approx(JUMP.verify_s)
    assert costs.draft_step_s == pytest.approx(JUMP.draft_step_s)


def test_a_deferred_background_task_waits_longer_each_time_and_is_never_starved():
    from speculation.worker.tasks import BACKGROUND_DEFER_S, MAX_DEFER_S, MAX_DEFERS, defer_s

    waits = [defer_s(n) for n in range(MAX_DEFERS)]
    assert waits[0] == BACKGROUND_DEFER_S and waits == sorted(waits) and max(waits) == MAX_DEFER_S
    assert sum(waits) < 180  # the task runs within three minutes whatever waits on the queue
