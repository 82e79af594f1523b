"""The goodput guard's cost rule: a request's expected length and the measured step costs decide whether it can gain;
measured goodput corrects the prediction per load and length instead of replacing it with one verdict for all.

Costs like those measured on a CPU worker: a 20 ms target step, c = 0.05, v(5) = 1.2, E[N] = 3 tokens a step at K = 5,
250 ms of setup a speculated request (tokenize call, queue, the worker's prefill): the bound is 2.07x, and a request
pays its setup back from about 24 tokens."""

from __future__ import annotations

import pytest

from speculation.gateway.guard import costs
from speculation.gateway.guard.rules import (
    CORRECTION_SAMPLES,
    CROWDED_MARGIN,
    GREEDY,
    PLAIN,
    SPEC,
    CostModel,
    by_cost,
    choose,
    verdict,
)

MEASURED = CostModel(target_step_s=0.020, c=0.05, v=1.2, k=5, tokens_per_step=3.0, setup_s=0.25)


def sample(tokens: int, seconds: float) -> tuple[float, float]:
    return (tokens / seconds, seconds)


# Mixed traffic at one stream: mostly short requests, which speculation served slower than plain, and a few long ones
# it served 1.7x faster. Per load alone, speculation measures slower (the verdict that held every request plain).
MIXED = {
    (GREEDY, "1", SPEC): [sample(8, 0.4)] * 16 + [sample(128, 1.5)] * 4,
    (GREEDY, "1", PLAIN): [sample(8, 0.16)] * 8 + [sample(128, 2.6)] * 8,
}


def test_a_cost_model_gains_its_bound_on_long_requests_and_pays_back_its_setup_from_a_length():
    assert round(MEASURED.bound, 3) == round(3.0 / (1.2 + 5 * 0.05), 3) == 2.069
    assert MEASURED.gain(10_000) == pytest.approx(MEASURED.bound, rel=0.01)
    assert MEASURED.gain(MEASURED.pays_from()) == pytest.approx(1.0)
    assert round(MEASURED.pays_from()) == 24
    assert round(MEASURED.gain(96), 2) == 1.63 and round(MEASURED.gain(8), 2) == 0.49
    slow = CostModel(target_step_s=0.02, c=0.3, v=1.5, k=5, tokens_per_step=2.0, setup_s=0.1)
    assert slow.bound < 1 and slow.pays_from() is None


def test_at_one_stream_long_requests_speculate_and_short_ones_go_plain_with_the_reasons():
    # given: mixed traffic at one stream, where the load's verdict alone sends every request plain
    assert verdict(MIXED[(GREEDY, "1", SPEC)], MIXED[(GREEDY, "1", PLAIN)]) == "slower"
    assert choose(MIXED, traffic=GREEDY, bucket="1", turn=0).plain
    # when: requests of 2 to 16 tokens and of 128 tokens arrive alone
    short = {n: by_cost(MIXED, MEASURED, tokens=n, traffic=GREEDY, bucket="1") for n in (2, 4, 8, 16)}
    long = by_cost(MIXED, MEASURED, tokens=128, traffic=GREEDY, bucket="1")

    # then: the long one speculates, predicted 1.72x and measured 1.73x for its length
    assert not long.plain
    assert long.reason.startswith("goodput guard: a request of up to 128 tokens is predicted 1.73x plain at load 1 (")
    assert "E[N] 3.00 tokens a step at K=5, c=0.050, v=1.20, 20.0 ms a target step, 250 ms setup a request" in (
        long.reason
    )
    assert "measured for 65-256-token requests at load 1: 1.73x where it predicted 1.72x over the last 4 / 8" in (
        long.reason
    )
    # and: every short one goes plain, saying why
    assert all(d.plain for d in short.values())
    assert short[8].reason.startswith("a request of up to 8 tokens is predicted 0.40x plain at load 1 (")
    assert "measured for 1-16-token requests at load 1: 0.40x where it predicted 0.49x" in short[8].reason
    assert short[8].reason.endswith(
        "below the 1x it needs; speculation pays from about 24 tokens alone (goodput guard)"
    )


def test_measured_goodput_corrects_the_prediction_of_its_own_length_only():
    # given: long requests measured no faster than plain (the model was optimistic for them)
    slow_long = {
        (GREEDY, "1", SPEC): [sample(128, 2.7)] * CORRECTION_SAMPLES,
        (GREEDY, "1", PLAIN): [sample(128, 2.6)] * CORRECTION_SAMPLES,
    }

    long = by_cost(slow_long, MEASURED, tokens=128, traffic=GREEDY, bucket="1")
    medium = by_cost(slow_long, MEASURED, tokens=60, traffic=GREEDY, bucket="1")

    assert long.plain and "0.96x plain" in long.reason and "65-256-token requests" in long.reason
    # a 60-token request has no measurement of its length: the prediction alone (1.45x) decides
    assert not medium.plain and "predicted 1.45x" in medium.reason and "no goodput measured for 17-64" in medium.reason


def test_speculation_measured_without_plain_of_its_length_measures_plain_every_other_request():
    spec_only = {(GREEDY, "1", SPEC): [sample(128, 1.5)] * CORRECTION_SAMPLES}

    decisions = [by_cost(spec_only, MEASURED, tokens=128, traffic=GREEDY, bucket="1", turn=t) for t in range(4)]

    assert [d.plain for d in decisions] == [False, True, False, True]
    assert decisions[1].reason == "measuring plain speed of 65-256-token requests at load 1 (goodput guard)"


def test_above_one_stream_short_requests_go_plain_and_long_ones_are_left_to_the_loads_rule():
    short = by_cost({}, MEASURED, tokens=32, traffic=GREEDY, bucket="5-16")
    long = by_cost({}, MEASURED, tokens=128, traffic=GREEDY, bucket="5-16")

    assert short.plain and f"below the {CROWDED_MARGIN:g}x it needs" in short.reason  # 1.1x alone is not enough
    assert long is None  # what its neighbours pay is the load's measured goodput (rules.choose)


@pytest.mark.django_db
def test_the_cost_model_is_read_from_the_newest_calibration_and_the_policys_records():
    from fleet.models import Endpoint
    from speculation.models import Action, CostCalibration, StageRecord

    endpoint = Endpoint.objects.create(name="costed", base_url="http://gpu-node.invalid:8000", kind="vllm")
    assert costs.measure(endpoint.pk, endpoint.node_class, "local", None, 5) is None  # nothing measured
    CostCalibration.objects.create(
        endpoint=endpoint, node_class=endpoint.node_class, path="local", target_step_ms=20.0, draft_step_ms=1.0,
        verify_ms={"6": 24.0}, repeats=5,
    )  # fmt: skip
    assert costs.measure(endpoint.pk, endpoint.node_class, "local", None, 5) is None  # no prod request measured yet
    # 40 verifications of 5 drafts, 80 accepted: E[N] = 3; each verification 24 + 5 x 1 ms; 250 ms beside them
    for i in range(3):
        StageRecord.objects.create(
            endpoint=endpoint, request_id=f"r{i}", mode="prod", action=Action.SPECULATED, target_passes=40,
            drafted_tokens=200, accepted_tokens=80, output_tokens=120, latency_ms=250.0 + 40 * 29.0 + 10 * (i - 1),
            path="local", mechanism="draft_model",
        )  # fmt: skip
    # a prod request on another path (the remote path's scoring calls: far slower), or of another mechanism, is
    # not this pairing's setup
    for i, (path, mechanism) in enumerate((("remote", "draft_model"), ("local", "eagle_head"))):
        StageRecord.objects.create(
            endpoint=endpoint, request_id=f"other{i}", mode="prod", action=Action.SPECULATED, target_passes=40,
            drafted_tokens=200, accepted_tokens=0, output_tokens=40, latency_ms=90_000.0, path=path,
            mechanism=mechanism,
        )  # fmt: skip

    model = costs.measure(endpoint.pk, endpoint.node_class, "local", None, 5, "draft_model")

    assert model.target_step_s == pytest.approx(0.020) and model.c == pytest.approx(0.05)
    assert model.v == pytest.approx(1.2) and model.k == 5 and model.tokens_per_step == pytest.approx(3.0)
    assert model.setup_s == pytest.approx(0.25)  # the median request's latency less its verifications


def test_the_rules_are_pure_they_import_neither_django_nor_redis():
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, speculation.gateway.guard.rules; print(sorted({'django', 'redis'} & set(sys.modules)))"
    root = Path(__file__).parents[3]
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    found = run.stdout.strip()

    assert found == "[]"


def test_the_cost_model_is_read_once_per_ttl_and_never_for_a_route_that_does_not_speculate(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    reads = []

    async def read(fn, *key):
        reads.append(key)
        return MEASURED

    monkeypatch.setattr(costs, "read", read)
    costs.forget()
    route = SimpleNamespace(endpoint_id=7, node_class="cpu", path="local", draft_id=None, k=5)

    async def run():
        return [await costs.cost_model(route) for _ in range(3)], await costs.cost_model(
            SimpleNamespace(endpoint_id=8, node_class="cpu", path="", draft_id=None, k=5)
        )

    try:
        models, no_path = asyncio.run(run())
    finally:
        costs.forget()

    assert models == [MEASURED] * 3 and reads == [(7, "cpu", "local", None, 5, "")]
    assert no_path is None
