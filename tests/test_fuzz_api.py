"""The fuzz run's short form: ACE under uvicorn with a real Redis and the real vLLM; 0 answers 5xx, 0 tracebacks.

The full run and its counts: `python manage.py fuzz_api` (docs/SECURITY.md).
"""

from __future__ import annotations

import random

import httpx
import pytest

from ace import fuzz
from ace.fuzz.gateway import GatewayReport, Upstream, _send, bodies


def test_the_gateway_tally_would_see_a_5xx_an_unshaped_error_and_a_missing_request_id(http_stub):
    # given a server that answers like a broken gateway
    stub = http_stub(
        {
            ("POST", "/v1/completions"): lambda r: (500, {"content-type": "text/html"}, b"<h1>Server Error</h1>"),
            ("POST", "/v1/chat/completions"): lambda r: (200, {"X-ACE-Request-Id": "abc"}, b"{}"),
        }
    )
    report = GatewayReport()
    # when the fuzz's sender sends to it
    with httpx.Client(base_url=stub.base_url) as http:
        _send(http, report, "prod", "/v1/completions", b"{}")
        _send(http, report, "prod", "/v1/chat/completions", b"{}")
    # then each problem is counted and kept
    assert report.server_errors == 1 and report.unshaped_errors == 1 and report.missing_request_id == 1
    assert {f["problem"] for f in report.findings} == {"5xx", "error is not OpenAI-shaped JSON", "no request id"}


def test_a_5xx_the_model_server_gives_for_the_same_body_is_counted_apart(http_stub):
    # given a model server that fails on one body, relayed as it is (off mode), and one that does not
    failing = http_stub({("POST", "/v1/completions"): lambda r: (500, {"X-ACE-Request-Id": "1"}, b'{"error": {}}')})
    healthy = http_stub({("POST", "/v1/completions"): lambda r: {"choices": []}})
    report = GatewayReport()
    with httpx.Client(base_url=failing.base_url) as http:
        for server in (failing, healthy):
            _send(http, report, "off", "/v1/completions", b'{"model": "x"}', upstream=Upstream(server.base_url, "m"))
    # then only the second is ACE's; the replay named the served model
    assert report.upstream_server_errors == 1 and report.server_errors == 1
    assert failing.requests[1].json() == {"model": "m"}  # the replay of the first send


def test_the_quick_bodies_are_the_same_for_the_same_seed_and_cover_both_routes():
    first = list(bodies("completion", "m", rng=random.Random(0), quick=True))
    again = list(bodies("completion", "m", rng=random.Random(0), quick=True))
    chat = list(bodies("chat", "m", rng=random.Random(0), quick=True))
    assert first == again
    assert b'{"model": "m", "max_tokens": 4, "temperature": 0}' in first  # the prompt left out
    assert b'{"model": "m", "max_tokens": 4, "temperature": 0}' in chat  # the messages left out
    assert b"[" * 50_000 in first and len(first) > 50


@pytest.mark.vllm
def test_a_short_fuzz_run_gets_no_5xx_and_leaves_no_traceback(vllm_server):
    with fuzz.FuzzStack(upstream=vllm_server.base_url) as stack:
        report = fuzz.run(stack, quick=True)
    assert report["gateway"]["requests"] > 300 and report["rest"]["requests"] > 100, report
    assert report["server_errors"] == 0, report["gateway"]["findings"] + report["rest"]["findings"]
    assert report["gateway"]["unshaped_errors"] == 0, report["gateway"]["findings"]
    assert report["gateway"]["missing_request_id"] == 0, report["gateway"]["findings"]
    assert report["log_tracebacks"] == 0, report["log_excerpts"]
