"""Every way an endpoint can fail is a recorded result with a kind and a reason, never an exception."""

from __future__ import annotations

import logging
import time

import pytest

from ace.processes import free_port
from fleet.adapters import FailureKind, adapter_for
from fleet.models import EndpointStatus
from fleet.probing import summarize
from tests.support.server_shapes import json_reply, models_route, openai_routes


def probe(kind: str, base_url: str, **kwargs):
    report = adapter_for(kind, base_url=base_url, **kwargs).probe()
    return report, summarize(report)


@pytest.mark.parametrize("kind", ["vllm", "sglang", "openai"])
def test_a_closed_port_is_unreachable_within_the_probe_timeout(kind):
    # given nothing listening on the port
    url = f"http://127.0.0.1:{free_port()}"
    # when
    report, (status, reason) = probe(kind, url)
    # then: refused at once, not waited out as a timeout
    assert report.fatal.kind == FailureKind.UNREACHABLE
    assert status == EndpointStatus.UNREACHABLE
    assert "connection refused" in reason


@pytest.mark.parametrize("code", [401, 403])
def test_a_refused_key_means_unauthorized(http_stub, code):
    stub = http_stub({("GET", "/v1/models"): lambda r: json_reply(code, {"error": "bad key"})})
    report, (status, reason) = probe("vllm", stub.base_url, api_key="wrong")
    assert report.fatal.kind == FailureKind.UNAUTHORIZED
    assert status == EndpointStatus.UNAUTHORIZED
    assert f"HTTP {code}" in reason


def test_a_404_says_wrong_path_or_wrong_kind(http_stub):
    stub = http_stub({})
    report, (status, reason) = probe("openai", stub.base_url)
    assert report.fatal.kind == FailureKind.NOT_FOUND
    assert status == EndpointStatus.ERROR
    assert "wrong base URL path or wrong server kind" in reason


def test_an_answer_that_is_not_json_is_reported(http_stub):
    html = (200, {"content-type": "text/html"}, b"<html>login page</html>")
    stub = http_stub({("GET", "/v1/models"): lambda r: html})
    report, (status, reason) = probe("vllm", stub.base_url)
    assert report.fatal.kind == FailureKind.NOT_JSON
    assert status == EndpointStatus.ERROR
    assert "not JSON" in reason and "text/html" in reason


@pytest.mark.parametrize(
    "body",
    [{"data": "nope"}, {"object": "list", "data": []}, [1, 2, 3], {"data": [{"name": "no id"}]}],
    ids=["data-not-a-list", "no-models", "not-an-object", "card-without-id"],
)
def test_a_wrong_shape_is_reported(http_stub, body):
    stub = http_stub({("GET", "/v1/models"): lambda r: body})
    report, (status, reason) = probe("vllm", stub.base_url)
    assert report.fatal.kind == FailureKind.WRONG_SHAPE
    assert status == EndpointStatus.ERROR
    assert reason.startswith("wrong_shape:")


def test_a_server_slower_than_the_timeout_is_reported_as_timeout(http_stub):
    def slow(request):
        time.sleep(1.5)
        return models_route(request)

    stub = http_stub({("GET", "/v1/models"): slow})
    report, (status, reason) = probe("openai", stub.base_url, timeout_s=0.3)
    assert report.fatal.kind == FailureKind.TIMEOUT
    assert status == EndpointStatus.UNREACHABLE
    assert "no answer within 0.3 s" in reason


def test_https_to_a_plain_http_server_is_a_tls_error(http_stub):
    stub = http_stub(openai_routes())
    report, (status, reason) = probe("openai", stub.base_url.replace("http://", "https://"))
    assert report.fatal.kind == FailureKind.TLS_ERROR
    assert status == EndpointStatus.ERROR
    assert "TLS error" in reason


def test_a_url_outside_the_allowed_networks_is_refused_before_connecting():
    report, (status, reason) = probe("vllm", "http://169.254.169.254")
    assert report.fatal.kind == FailureKind.NOT_ALLOWED
    assert status == EndpointStatus.ERROR
    assert "outside the allowed networks" in reason


def test_the_api_key_goes_in_the_bearer_header_and_nowhere_else(http_stub, caplog):
    secret = "sk-very-secret-0123456789"

    def guarded(route):
        def handler(request):
            if request.headers.get("authorization") != f"Bearer {secret}":
                return json_reply(401, {"error": "unauthorized"})
            return route(request)

        return handler

    stub = http_stub({key: guarded(route) for key, route in openai_routes().items()})
    caplog.set_level(logging.DEBUG)
    report, (status, reason) = probe("openai", stub.base_url, api_key=secret)
    assert status == EndpointStatus.READY, report.errors
    assert all(r.headers["authorization"] == f"Bearer {secret}" for r in stub.requests)
    assert all(secret not in r.path + r.query + r.body.decode() for r in stub.requests)
    assert secret not in caplog.text
    assert secret not in repr(report) + reason
    assert secret not in repr(adapter_for("openai", base_url=stub.base_url, api_key=secret))


def test_a_failed_optional_capability_is_recorded_and_the_endpoint_stays_ready(http_stub):
    routes = openai_routes()
    completions = routes[("POST", "/v1/completions")]

    def no_echo(request):
        if request.json().get("echo"):
            return json_reply(400, {"error": {"message": "echo is not supported"}})
        return completions(request)

    routes[("POST", "/v1/completions")] = no_echo
    stub = http_stub(routes)
    report, (status, reason) = probe("openai", stub.base_url)
    assert status == EndpointStatus.READY
    assert report.capabilities["prompt_scoring"] is False
    assert [e["step"] for e in report.errors] == ["prompt_scoring"]
    assert "echo is not supported" in report.errors[0]["message"]
    assert "prompt_scoring" in reason


def test_a_server_that_lists_models_but_cannot_generate_is_degraded(http_stub):
    stub = http_stub({("GET", "/v1/models"): models_route})  # every completion is a 404
    report, (status, reason) = probe("openai", stub.base_url)
    assert report.ok
    assert status == EndpointStatus.DEGRADED
    assert "cannot generate" in reason
    assert {"token_id_prompts", "prompt_scoring", "latency"} <= {e["step"] for e in report.errors}


def test_a_broken_stream_is_a_recorded_failure_not_a_crash(http_stub):
    routes = openai_routes()
    completions = routes[("POST", "/v1/completions")]

    def garbled_stream(request):
        if request.json().get("stream"):
            return 200, {"content-type": "text/event-stream"}, b"data: {not json\n\n"
        return completions(request)

    routes[("POST", "/v1/completions")] = garbled_stream
    stub = http_stub(routes)
    report, (status, _) = probe("openai", stub.base_url)
    assert status == EndpointStatus.DEGRADED
    assert {"step": "latency", "kind": "not_json"}.items() <= report.errors[-1].items()
