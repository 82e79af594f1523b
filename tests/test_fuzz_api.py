"""The fuzz run's short form: ACE under uvicorn with a real Redis and the real vLLM; 0 answers 5xx, 0 tracebacks.

The full run and its counts: `python manage.py fuzz_api` (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import random
from urllib.parse import quote

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


def test_the_gateway_bodies_carry_every_input_class_in_the_full_run():
    from ace.fuzz.classes import CONTROL_STRINGS, DEEP_JSON, UNICODE_DIGITS

    sent = list(bodies("chat", "m", rng=random.Random(0), quick=False))
    assert DEEP_JSON in sent
    text = b"\n".join(sent).decode(errors="replace")
    assert all(json.dumps(value)[1:-1] in text for value in [*CONTROL_STRINGS, *UNICODE_DIGITS])
    assert '"response_format": ' + "[" * 100 in text


def test_the_rest_cases_reach_every_operation_with_every_class():
    from ace.fuzz.classes import DEEP_JSON, IMPOSSIBLE_DATES, rest_cases

    schema = {
        "paths": {
            "/api/v1/things/": {
                "get": {"parameters": [{"name": "since", "in": "query"}]},
                "post": {
                    "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/T"}}}}
                },
            },
            "/api/v1/things/{id}/": {"delete": {"parameters": [{"name": "id", "in": "path"}]}},
        },
        "components": {"schemas": {"T": {"properties": {"name": {"type": "string"}}}}},
    }
    cases = list(rest_cases(schema, path_id=7, quick=False))
    assert {c.method for c in cases} == {"get", "post", "delete"}
    assert any(c.path.endswith("since=" + quote(IMPOSSIBLE_DATES[0], safe="")) for c in cases)
    assert any(c.body == DEEP_JSON for c in cases)
    assert any(c.body == json.dumps({"name": "a\r\nb"}).encode() for c in cases)
    deletes = [c.path for c in cases if c.method == "delete"]
    assert deletes and "/7/" not in " ".join(deletes)  # an existing id is never deleted


@pytest.mark.django_db
def test_the_rest_classes_over_this_schema_get_no_5xx(client, django_user_model):
    """The input classes over ACE's own schema, in process (the uvicorn form runs in `fuzz_api`)."""
    from ace.fuzz.classes import rest_cases
    from fleet import services

    client.force_login(django_user_model.objects.create_superuser("fuzz-admin", password="pw-for-tests-only"))
    schema = client.get("/api/schema/", {"format": "json"}).json()
    endpoint = services.create_endpoint(name="fuzz-classes", base_url="http://127.0.0.1:9")
    answers: dict[str, int] = {}
    for case in rest_cases(schema, path_id=endpoint.pk, quick=True):
        response = client.generic(case.method.upper(), case.path, case.body or b"", content_type="application/json")
        answers[case.label] = response.status_code
    assert len(answers) > 300
    assert [label for label, status in answers.items() if status >= 500] == []


def test_a_server_that_drops_the_connection_on_a_body_counts_as_its_own_failure():
    import socket
    import threading

    # given a server that reads a request and closes the connection without answering
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def drop() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            conn.recv(65536)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    assert Upstream(f"http://127.0.0.1:{port}", "m").also_fails("/v1/completions", b'{"model": "x"}', 5)
    listener.close()
