"""Traffic capture through the gateway: only for endpoints that opted in, never for a request that opts out, with the
token ids the server produced, and the client's answer as an uncaptured request gets it.

The upstream is a stub with vLLM's completion shape (token_ids / prompt_token_ids only with return_token_ids, as
test_gateway_server_kinds.py); vLLM's own answers run through shadow's reader in test_gateway_modes.py.
"""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

from speculation.models import CapturedRequest, CaptureSetting, Mode, SpeculationPolicy
from speculation.services import captures

MODEL = "stub-model"
PROMPT_IDS = [11, 12, 13]
OUTPUT_IDS = [21, 22]
PLAIN_CHOICE = {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}


def completions(request) -> tuple[int, dict, bytes]:
    body = request.json()
    # vLLM's fields without the flag: null
    choice = {**PLAIN_CHOICE, "token_ids": None, "prompt_token_ids": None}
    if body.get("return_token_ids"):
        choice.update(token_ids=OUTPUT_IDS, prompt_token_ids=PROMPT_IDS)
    if not body.get("stream"):
        answer = {"id": "c", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": None}
        return 200, {"content-type": "application/json"}, json.dumps(answer).encode()
    first = {**choice, "text": "a", "finish_reason": None, "token_ids": choice["token_ids"] and OUTPUT_IDS[:1]}
    last = {**choice, "text": "b", "token_ids": choice["token_ids"] and OUTPUT_IDS[1:]}
    last["prompt_token_ids"] = None
    events = [{"id": "c", "object": "text_completion", "model": MODEL, "choices": [c]} for c in (first, last)]
    stream = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return 200, {"content-type": "text/event-stream"}, stream


@pytest.fixture(autouse=True)
def _fresh(fresh_caches):
    """Every test here starts with empty route and token caches."""


@pytest.fixture
def setup(http_stub, django_user_model, redis_server):
    from rest_framework.authtoken.models import Token

    from fleet.models import Endpoint

    def make(*, mode: str = Mode.OFF, capture: bool = True, rate: float = 1.0):
        stub = http_stub({("POST", "/v1/completions"): completions})
        endpoint = Endpoint.objects.create(
            name=f"capture-{mode}", base_url=stub.base_url, kind="vllm", served_model=MODEL, status="ready"
        )
        SpeculationPolicy.objects.create(endpoint=endpoint, mode=mode, shadow_sample_rate=0.0)
        if capture:
            CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=rate)
        admin = django_user_model.objects.create_superuser(username=f"cap-{mode}", password="pw-for-tests-only")
        return endpoint, stub, Token.objects.create(user=admin).key

    return make


def ask(endpoint, token: str, *, stream: bool = False, headers: dict | None = None, **body) -> dict | bytes:
    async def go():
        response = await AsyncClient().post(
            "/v1/completions",
            data={"model": endpoint.name, "prompt": "hi", "max_tokens": 2, "temperature": 0, "stream": stream, **body},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}", **(headers or {})},
        )
        assert response.status_code == 200
        content = b"".join([part async for part in response.streaming_content]) if stream else response.content
        await captures.aflush()  # what the flusher writes within a second, written now
        return content

    content = async_to_sync(go)()
    return content if stream else json.loads(content)


@pytest.mark.django_db
@pytest.mark.parametrize("mode", [Mode.OFF, Mode.SHADOW])
def test_it_captures_the_served_token_ids_of_an_opted_in_endpoint_in_every_mode(setup, mode):
    # given an endpoint of this mode that captures every request
    endpoint, stub, token = setup(mode=mode)
    # when a client asks it without token ids
    answer = ask(endpoint, token, headers={"X-ACE-Workload": "faq"})
    # then the server was asked for them, the client's answer is the one it sends without them
    assert stub.requests[-1].json()["return_token_ids"] is True
    assert answer["choices"][0] == {**PLAIN_CHOICE, "token_ids": None, "prompt_token_ids": None}
    # and the capture holds the ids the server produced, with the request's workload and mode
    row = CapturedRequest.objects.get(endpoint=endpoint)
    assert captures.open_capture(row) == (PROMPT_IDS, OUTPUT_IDS)
    assert (row.workload, row.mode, row.prompt_tokens, row.output_tokens, row.greedy) == ("faq", mode, 3, 2, True)


@pytest.mark.django_db
def test_it_captures_a_streamed_answer_and_strips_the_ids_it_asked_for(setup):
    endpoint, stub, token = setup()
    raw = ask(endpoint, token, stream=True)
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events] == ["a", "b"]
    assert all(e["choices"][0]["token_ids"] is None and e["choices"][0]["prompt_token_ids"] is None for e in events)
    assert captures.open_capture(CapturedRequest.objects.get(endpoint=endpoint)) == (PROMPT_IDS, OUTPUT_IDS)


@pytest.mark.django_db
def test_a_sampled_request_is_kept_as_sampled(setup):
    endpoint, stub, token = setup()
    ask(endpoint, token, temperature=0.8)
    assert CapturedRequest.objects.get(endpoint=endpoint).greedy is False


@pytest.mark.django_db
def test_it_leaves_the_ids_a_client_asked_for_itself(setup):
    endpoint, stub, token = setup()
    answer = ask(endpoint, token, return_token_ids=True)
    assert answer["choices"][0]["token_ids"] == OUTPUT_IDS
    assert CapturedRequest.objects.filter(endpoint=endpoint).count() == 1


@pytest.mark.django_db
def test_capture_is_off_by_default(setup):
    # given an endpoint that never opted in
    endpoint, stub, token = setup(capture=False)
    assert CaptureSetting(endpoint=endpoint).enabled is False
    # when it serves a request
    ask(endpoint, token)
    # then nothing was asked of the server beyond the client's request, and nothing kept
    assert "return_token_ids" not in stub.requests[-1].json()
    assert not CapturedRequest.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_a_request_with_the_opt_out_header_is_never_captured(setup, value):
    endpoint, stub, token = setup()
    ask(endpoint, token, headers={"X-ACE-No-Capture": value})
    assert "return_token_ids" not in stub.requests[-1].json()
    assert not CapturedRequest.objects.exists()


@pytest.mark.django_db
def test_a_capture_queued_after_the_endpoint_opted_out_is_not_written(setup):
    # given a capture queued while the setting was on, then turned off before the flush
    endpoint, _, _ = setup()
    CaptureSetting.objects.filter(endpoint=endpoint).update(enabled=False)
    rows = [dict(endpoint_id=endpoint.pk, workload="", mode="off", prompt_ids=[1], output_ids=[2])]
    # then the writer drops it
    assert captures.write_captures(rows) == 0
    assert not CapturedRequest.objects.exists()


@pytest.mark.django_db
def test_a_rate_of_zero_captures_nothing(setup):
    endpoint, stub, token = setup(rate=0.0)
    for _ in range(5):
        ask(endpoint, token)
    assert not CapturedRequest.objects.exists()


@pytest.mark.django_db
def test_the_lean_app_honours_the_opt_out_header(setup):
    import httpx

    from ace.asgi import application

    # given an off endpoint that captures every request
    endpoint, stub, token = setup()

    async def go() -> None:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            for extra in ({"X-ACE-No-Capture": "1"}, {}):
                body = {"model": endpoint.name, "prompt": "hi", "max_tokens": 2, "temperature": 0}
                response = await client.post(
                    "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}", **extra}
                )
                assert response.status_code == 200
        await captures.aflush()

    # when one request opts out and one does not, through ace.asgi.application (what serves /v1)
    async_to_sync(go)()
    # then only the other was captured
    assert ["return_token_ids" in r.json() for r in stub.requests] == [False, True]
    assert CapturedRequest.objects.filter(endpoint=endpoint).count() == 1


@pytest.mark.parametrize("stream", [False, True])
def test_prods_own_answers_give_their_ids_and_read_as_without_them(monkeypatch, stream):
    """Prod answers with ACE's own vLLM-shaped response (speculation.gateway.openai_format.Shape): what capture asks
    of it (return_token_ids) it reads back and strips to null, as vLLM sends it without the flag."""
    from types import SimpleNamespace

    from fleet.adapters import wire_for
    from speculation.gateway import capture
    from speculation.gateway.openai_format import Shape

    kept: list[dict] = []
    monkeypatch.setattr(capture, "keep_capture", lambda **row: kept.append(row))
    route = SimpleNamespace(endpoint_id=7, mode=Mode.PROD)
    call = SimpleNamespace(route=route, request_id="r", body={}, kind="completion", workload="w")
    tap = capture.CaptureTap(call, injected=True, wire=wire_for("vllm"), workload="w")
    shape = Shape(kind="completion", request_id="r", model=MODEL, prompt_ids=PROMPT_IDS, return_token_ids=True)
    if stream:
        parts = [shape.chunk("a", OUTPUT_IDS[:1], first=True), shape.chunk("b", OUTPUT_IDS[1:], first=False),
                 shape.chunk("", [], finish_reason="length", first=False)]  # fmt: skip
        out = b"".join(tap.on_chunk(part) for part in parts)
        events = [json.loads(line[6:]) for line in out.decode().split("\n\n") if line.startswith("data: {")]
        assert all(e["choices"][0]["token_ids"] is None for e in events)
        tap.done(complete=True)
    else:
        body = json.dumps(shape.response("ab", OUTPUT_IDS, "length", None)).encode()
        choice = json.loads(tap.on_body(200, body))["choices"][0]
        assert (choice["token_ids"], choice["prompt_token_ids"]) == (None, None)
        tap.done(complete=True)
    assert [(r["prompt_ids"], r["output_ids"], r["mode"]) for r in kept] == [(PROMPT_IDS, OUTPUT_IDS, Mode.PROD)]
