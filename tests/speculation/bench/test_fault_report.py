"""The fault run's report logic (speculation.bench.faults): how a response is read and classified, and
what the summary counts. The fault run itself is a command (manage.py fault_run), not a test."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from speculation.bench.faults import Outcome, classify, one_request, phase_at, summarize
from speculation.gateway.errors import REQUEST_ID_HEADER
from speculation.selectors.metrics import reason_class

SSE = {"content-type": "text/event-stream"}


def _chunk(text: str, finish: str | None = None) -> str:
    payload = {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return f"data: {json.dumps(payload)}\n\n"


def _fetch(base_url: str, hang_s: float = 5.0) -> Outcome:
    async def go() -> Outcome:
        async with httpx.AsyncClient(timeout=30) as client:
            return await one_request(
                client,
                base_url + "/v1/chat/completions",
                body={"model": "m"},
                headers={},
                hang_s=hang_s,
                outcome=Outcome(lane=0, prompt=0, started_s=0.0),
            )

    return asyncio.run(go())


def test_a_whole_stream_with_the_expected_text_is_correct(http_stub):
    body = _chunk("Hello") + _chunk(" world", "length") + "data: [DONE]\n\n"
    headers = {**SSE, REQUEST_ID_HEADER: "r1"}
    stub = http_stub({("POST", "/v1/chat/completions"): lambda r: (200, headers, body.encode())})
    outcome = _fetch(stub.base_url)
    assert (outcome.text, outcome.done, outcome.request_id) == ("Hello world", True, "r1")
    assert classify(outcome, "Hello world") == "correct"
    assert classify(outcome, "Hello there") == "wrong_text"


def test_a_stream_cut_without_done_or_error_is_truncated(http_stub):
    body = _chunk("Hello")
    stub = http_stub({("POST", "/v1/chat/completions"): lambda r: (200, SSE, body.encode())})
    assert classify(_fetch(stub.base_url), "Hello world") == "truncated"


def test_an_error_event_in_the_stream_is_a_clear_error(http_stub):
    body = _chunk("Hello") + 'data: {"error": {"message": "endpoint went away", "code": 502}}\n\n' + "data: [DONE]\n\n"
    stub = http_stub({("POST", "/v1/chat/completions"): lambda r: (200, SSE, body.encode())})
    outcome = _fetch(stub.base_url)
    assert classify(outcome, "Hello world") == "clear_error"
    assert outcome.error == "endpoint went away"


def test_http_errors_are_clear_only_with_an_openai_error_body(http_stub):
    clear = json.dumps({"error": {"message": "endpoint demo unreachable: ConnectError", "code": "upstream"}})
    stub = http_stub(
        {
            ("POST", "/v1/chat/completions"): lambda r: (502, {"content-type": "application/json"}, clear.encode()),
            ("POST", "/bare/v1/chat/completions"): lambda r: (500, {"content-type": "text/html"}, b"<h1>Error</h1>"),
        }
    )
    assert classify(_fetch(stub.base_url), "x") == "clear_error"
    assert classify(_fetch(stub.base_url + "/bare"), "x") == "unclear_error"


def test_a_server_that_goes_silent_is_a_hang(http_stub):
    def slow(request):
        time.sleep(1.5)
        return (200, SSE, b"data: [DONE]\n\n")

    stub = http_stub({("POST", "/v1/chat/completions"): slow})
    outcome = _fetch(stub.base_url, hang_s=0.3)
    assert outcome.timed_out
    assert classify(outcome, "x") == "hang"


def test_ace_not_answering_is_unreachable():
    from ace.processes import free_port

    assert classify(_fetch(f"http://127.0.0.1:{free_port()}"), "x") == "unreachable"


def test_phases_follow_the_fault_timeline():
    events = [(10.0, "worker_sigkill"), (20.0, "worker_up"), (30.0, "redis_stop")]
    assert [phase_at(t, events) for t in (0.0, 10.0, 25.0, 99.0)] == [
        "steady",
        "worker_sigkill",
        "worker_up",
        "redis_stop",
    ]


def _done(request_id: str, text: str, started_s: float = 0.0) -> Outcome:
    return Outcome(lane=0, prompt=0, started_s=started_s, status=200, request_id=request_id, text=text, done=True)


def test_the_summary_counts_outcomes_phases_records_and_the_verdict():
    expected = {0: "ok"}
    outcomes = [
        _done("a", "ok"),
        _done("b", "ok", started_s=15.0),
        Outcome(lane=1, prompt=0, started_s=16.0, status=502, request_id="c", error="endpoint demo unreachable"),
    ]
    records = {
        "a": {"request_id": "a", "action": "speculated", "reason": ""},
        "b": {"request_id": "b", "action": "fell_back", "reason": "worker sent nothing for 15 s after 3 tokens"},
        "c": {"request_id": "c", "action": "fell_back", "reason": "tokenize failed: /tokenize: ConnectError"},
    }
    summary = summarize(
        outcomes, expected=expected, records=records, events=[(10.0, "worker_sigkill")], reason_class=reason_class
    )
    assert summary["requests"] == 3
    assert summary["outcomes"]["correct"] == 2
    assert summary["outcomes"]["clear_error"] == 1
    assert summary["by_phase"] == {"steady": {"correct": 1}, "worker_sigkill": {"correct": 1, "clear_error": 1}}
    assert summary["records_by_action"] == {"speculated": 1, "fell_back": 2}
    assert summary["fallback_reasons"] == {"worker_timeout": 1, "tokenize_failed": 1}
    assert summary["completed_without_record"] == 0
    assert summary["passed"] is True


@pytest.mark.parametrize(
    ("outcome", "records", "why"),
    [
        (_done("a", "ok"), {}, "a completed request without its record"),
        (_done("a", "wrong"), {"a": {"request_id": "a", "action": "speculated"}}, "wrong text"),
        (
            Outcome(lane=0, prompt=0, started_s=0.0, status=200, request_id="a", text="o"),
            {"a": {"request_id": "a", "action": "fell_back"}},
            "a truncated stream",
        ),
    ],
)
def test_the_verdict_fails_on(outcome, records, why):
    summary = summarize([outcome], expected={0: "ok"}, records=records, events=[])
    assert summary["passed"] is False, why
