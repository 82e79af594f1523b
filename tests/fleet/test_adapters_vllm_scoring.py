"""How the vLLM adapter's probe decides on prompt scoring: vLLM's `prompt_logprobs` first; the OpenAI
echo+logprobs route only when the server refuses it, never because one call was slow (a timeout is a recorded
failure of the step, not a refusal). The real vLLM case is in test_probing_vllm.py."""

from __future__ import annotations

import time

from fleet.adapters import FailureKind, adapter_for
from tests.support.server_shapes import json_reply, openai_routes


def vllm_routes(on_prompt_logprobs) -> dict:
    routes = openai_routes(max_logprobs=5)
    echo_and_plain = routes[("POST", "/v1/completions")]

    def completions(request):
        if request.json().get("prompt_logprobs") is not None:
            return on_prompt_logprobs(request)
        return echo_and_plain(request)

    return {**routes, ("POST", "/v1/completions"): completions}


def scoring_errors(report) -> list[dict]:
    return [e for e in report.errors if e["step"] == "prompt_scoring"]


def test_a_refused_prompt_logprobs_falls_back_to_echo_logprobs(http_stub):
    stub = http_stub(vllm_routes(lambda request: json_reply(400, {"error": {"message": "unknown field"}})))
    report = adapter_for("vllm", base_url=stub.base_url, timeout_s=5).probe()
    assert scoring_errors(report) == []
    assert report.capabilities["prompt_scoring_method"] == "echo_logprobs"
    assert report.capabilities["max_logprobs"] == 5


def test_a_slow_prompt_logprobs_call_is_a_recorded_timeout_not_a_fallback(http_stub):
    def slow(request):
        time.sleep(1.5)
        return json_reply(500, {})

    stub = http_stub(vllm_routes(slow))
    report = adapter_for("vllm", base_url=stub.base_url, timeout_s=0.5).probe()
    assert [e["kind"] for e in scoring_errors(report)] == [FailureKind.TIMEOUT]
    assert report.capabilities["prompt_scoring"] is False
    assert report.capabilities["prompt_scoring_method"] is None
