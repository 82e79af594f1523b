"""How the vLLM adapter reads native speculation from /metrics when /server_info is not there (no dev mode).

The metric lines have the shape a real vLLM 0.32 with --speculative-config exposes (labels model_name,
engine, position; counters registered only when speculation is on). The real servers are in
test_probing_vllm.py; this pins the parsing for a server without VLLM_SERVER_DEV_MODE.
"""

from __future__ import annotations

import time

from fleet.adapters import FailureKind, adapter_for
from fleet.adapters.openai import PROBE_BUDGET_TIMEOUTS
from tests.support.server_shapes import openai_routes

PLAIN_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:generation_tokens_total{engine="0",model_name="m"} 48.0
"""

SPEC_METRICS = PLAIN_METRICS + "".join(
    [
        "# TYPE vllm:spec_decode_num_drafts counter\n",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0\n',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 48.0\n',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0\n',
    ]
    + [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} 5.0\n'
        for i in range(4)
    ]
)


def vllm_routes(metrics: str) -> dict:
    return {**openai_routes(), ("GET", "/metrics"): lambda r: (200, {"content-type": "text/plain"}, metrics.encode())}


def test_spec_decode_counters_mean_native_speculation_with_k_from_the_positions(http_stub):
    stub = http_stub(vllm_routes(SPEC_METRICS))
    caps = adapter_for("vllm", base_url=stub.base_url).probe().capabilities
    assert caps["native_speculation"] is True
    assert caps["native_speculation_k"] == 4
    assert caps["native_speculation_method"] is None  # only /server_info (dev mode) names it
    assert caps["native_speculation_source"] == "metrics"


def test_no_spec_decode_counters_mean_no_native_speculation(http_stub):
    stub = http_stub(vllm_routes(PLAIN_METRICS))
    caps = adapter_for("vllm", base_url=stub.base_url).probe().capabilities
    assert caps["native_speculation"] is False
    assert caps["native_speculation_k"] is None


def test_a_slow_server_cannot_hold_the_probe_much_longer_than_its_budget(http_stub):
    # given a server that lists its models at once but answers everything else after 3 timeouts
    timeout_s = 0.3

    slow_requests: list[str] = []

    def slow(route):
        def handler(request):
            slow_requests.append(request.path)
            time.sleep(timeout_s * 3)
            return route(request)

        return handler

    routes = {key: (route if key == ("GET", "/v1/models") else slow(route)) for key, route in vllm_routes("").items()}
    for key in (("GET", "/version"), ("POST", "/tokenize")):  # everything else, vLLM's own routes included
        routes.setdefault(key, slow(lambda request: (404, {}, b"")))
    stub = http_stub(routes)
    # when
    report = adapter_for("vllm", base_url=stub.base_url, timeout_s=timeout_s).probe()
    # then the last steps are skipped once the budget is spent: each slow request costs one timeout, so at most
    # the budget's worth of them is sent, plus a step started just before it runs out (prompt scoring: two)
    assert 0 < len(slow_requests) <= PROBE_BUDGET_TIMEOUTS + 3
    skipped = [e["step"] for e in report.errors if e["kind"] == FailureKind.TIMEOUT and "budget" in e["message"]]
    assert skipped and skipped[-1] == "latency"
