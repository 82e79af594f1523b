"""Prod's measured multiplier and shadow's projection are over the same stored server step.

Prod's multiplier is its tok/s x the server's plain decode step of the newest calibration stored for the key
shadow projects with (speculation.worker.costs.prod_server_step_ms), so the ratio of the two carries no second,
differently timed plain-speed measurement. The end-to-end baseline stays in the record as baseline_tok_s. Real
task body, real Redis, the tiny model on the local path; no wall-clock assert (the arithmetic is checked on the
rates the records carry)."""

from __future__ import annotations

import json
import time

import pytest

from speculation.bench.concurrency import split
from speculation.engine.projection import StepCosts
from speculation.jobs.admission import inflight_key
from tests.speculation.worker.conftest import local_prod_endpoint

STEP_MS = 40.0  # the stored server step, far from the end-to-end baseline (100 tok/s = 10 ms a token)
COSTS = StepCosts(target_step_s=STEP_MS / 1000.0, draft_step_s=0.002, verify_s={1: 0.020, 4: 0.030, 9: 0.060})


@pytest.fixture
def prod_setup(db, redis_server, client, tiny_model_dir, settings):
    settings.CANDIDATE_REPLAYS_PER_MINUTE = 0  # the policy's own projection only
    return local_prod_endpoint(client, name="tiny-mult", target_dir=tiny_model_dir, draft_dir=tiny_model_dir)


def _store_calibration(endpoint, policy):
    from speculation.services.costs import record_calibration
    from speculation.worker.costs import cost_key

    key = cost_key(endpoint=endpoint, policy=policy)  # the key shadow projects with
    return record_calibration(
        endpoint=endpoint, draft=policy.draft, path=key.path, costs=COSTS, repeats=5, context_tokens=4
    )


def _run_prod(client, endpoint, prompt: list[int]) -> dict:
    from speculation.jobs.channel import key
    from speculation.worker.generation import run_prod_generation

    request_id = f"mult-{time.monotonic_ns()}"
    client.zadd(inflight_key("cpu"), {request_id: time.time() + 60})
    run_prod_generation(
        {
            "request_id": request_id,
            "endpoint_id": endpoint.pk,
            "prompt_ids": prompt,
            "max_tokens": 24,
            "k": 3,
            "path": "local",
            "sampling": {"temperature": 0.0},
            "stop": {"ignore_eos": True},
            "node_class": "cpu",
        }
    )
    messages = [json.loads(m) for m in client.lrange(key(request_id), 0, -1)]
    done = [m for m in messages if m["type"] == "done"]
    assert done, messages
    return {**done[0]["stats"], "ids": [i for m in messages if m["type"] == "tokens" for i in m["ids"]]}


def test_prods_multiplier_is_its_rate_times_the_stored_server_step_and_keeps_the_end_to_end_baseline(
    prod_setup, client
):
    endpoint, policy = prod_setup
    row = _store_calibration(endpoint, policy)

    stats = _run_prod(client, endpoint, [1, 5, 6, 7])

    assert stats["server_step_ms"] == row.target_step_ms == STEP_MS
    assert stats["baseline_tok_s"] == 100.0  # kept beside it, not divided by
    # the decode rate (after the first step: the prefill is not in it, as the server step has no prefill in it)
    assert stats["decode_tok_s"] is not None and stats["target_passes"] > 1
    assert stats["multiplier"] == pytest.approx(stats["decode_tok_s"] * STEP_MS / 1000.0)
    assert stats["multiplier"] != pytest.approx(stats["tok_s"] / 100.0)


def test_without_a_calibration_prods_multiplier_is_over_the_end_to_end_baseline_and_says_so(prod_setup, client):
    endpoint, _ = prod_setup

    stats = _run_prod(client, endpoint, [1, 5, 6, 7])

    assert stats["server_step_ms"] is None
    assert stats["multiplier"] == pytest.approx(stats["tok_s"] / 100.0)


def test_shadow_and_prod_on_the_same_request_divide_by_the_same_step_so_their_ratio_is_the_cost_models_error(
    prod_setup, client, settings
):
    from speculation.models import StageRecord
    from speculation.worker.shadow import measure_shadow

    # prod drafts the policy's K every step, so shadow projects that K by the closed formula below (where the batch
    # chooses K per step, shadow models its controller: tests/speculation/worker/test_shadow_costs.py)
    settings.PROD_BATCH_LOAD_AWARE_K = False
    endpoint, policy = prod_setup
    _store_calibration(endpoint, policy)
    prompt = [1, 5, 6, 7, 9, 14]
    stats = _run_prod(client, endpoint, prompt)
    # the same greedy request shadowed: served plainly in 5 s (a latency that must not enter either side)
    measure_shadow(
        endpoint_id=endpoint.pk,
        request_id="mult-shadow",
        prompt_ids=prompt,
        output_ids=stats["ids"],
        finish_reason="length",
        max_tokens=len(stats["ids"]),
        temperature=0.0,
        latency_ms=5000.0,
    )
    shadow = StageRecord.objects.get(request_id="mult-shadow")

    # shadow: S = E[N] x step / (verify(K + 1) + K draft), the stored costs in seconds, K the mean drafted per step
    k_mean = shadow.drafted_tokens / shadow.target_passes
    worker_step = COSTS.v(k_mean) * COSTS.target_step_s + k_mean * COSTS.draft_step_s
    assert shadow.multiplier == pytest.approx(shadow.mean_accepted_len * COSTS.target_step_s / worker_step)
    assert shadow.server_step_ms == stats["server_step_ms"] == STEP_MS
    # the ratio splits into the tokens per step each side counted (prod's lookahead may choose another K per step
    # than the policy's K shadow replays) and the worker step measured vs projected: no plain-speed term is left
    shadow_row = {
        "multiplier": shadow.multiplier,
        "mean_accepted_len": shadow.mean_accepted_len,
        "server_step_ms": shadow.server_step_ms,
    }
    prod_row = {**stats, "output_tokens": len(stats["ids"])}
    parts = split(shadow_row, prod_row)
    assert parts["plain_side"] == 1.0
    measured_step_s = len(stats["ids"]) / stats["decode_tok_s"] / stats["target_passes"]
    assert parts["worker_side"] == pytest.approx(measured_step_s / worker_step)
    assert parts["worker_side"] * parts["tokens_side"] == pytest.approx(shadow.multiplier / stats["multiplier"])
