"""The gateway refuses what the model server would refuse, OpenAI-shaped, with its request id; never a 500.

In prod and shadow a body the server would refuse (`temperature: "hot"` or `[0]`, `top_p` 0 or 2, `prompt: ""`)
is an OpenAI-shaped 400 and nothing is speculated; a 20 MB body is an OpenAI-shaped 413.
"""

from __future__ import annotations

import json

import pytest

from fleet.models import Endpoint, EndpointStatus
from speculation.gateway.errors import REQUEST_ID_HEADER
from speculation.gateway.validation import checked, problem
from speculation.models import Mode, SpeculationPolicy, StageRecord

COMPLETION = {"model": "m", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}

BAD_COMPLETIONS = [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": [0]}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "nan"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 2}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [["a"]]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "eight"}, "max_tokens"),
    ({"max_tokens": 1e400}, "max_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),  # found by the fuzz run: vLLM answered it in another shape
    ({"n": 0}, "n"),
    ({"stream": "maybe"}, "stream"),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options"),
    ({"stop": [1]}, "stop"),
    ({"seed": 2**64}, "seed"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": "five"}, "logprobs"),
    ({"echo": 2}, "echo"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": ["hi"]}, "messages"),
    ({"logprobs": 5}, "logprobs"),
    ({"top_logprobs": "x"}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS)
def test_each_bad_completion_field_is_named(change, param):
    found = problem({**COMPLETION, **change}, kind="completion")
    assert found is not None and found.param == param


@pytest.mark.parametrize(("change", "param"), BAD_CHATS)
def test_each_bad_chat_field_is_named(change, param):
    found = problem({**CHAT, **change}, kind="chat")
    assert found is not None and found.param == param


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (COMPLETION, "completion"),
        ({**COMPLETION, "prompt": [1, 2, 3], "temperature": 0.7, "top_p": 0.9, "top_k": -1, "seed": 3}, "completion"),
        ({**COMPLETION, "prompt": ["a", "b"], "stop": "\n", "n": 2, "stream": True}, "completion"),
        ({**COMPLETION, "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 1}, "completion"),
        ({**COMPLETION, "unknown_field": {"left": "to the server"}}, "completion"),
        (CHAT, "chat"),
        (
            {
                **CHAT,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "logprobs": True,
                "top_logprobs": 2,
                "stream_options": {"include_usage": True},
            },
            "chat",
        ),  # fmt: skip
        ({**CHAT, "messages": [{"role": "assistant", "content": None, "tool_calls": []}]}, "chat"),
    ],
)
def test_bodies_the_server_accepts_pass(body, kind):
    assert problem(body, kind=kind) is None


def test_values_the_server_takes_in_its_lax_mode_pass_and_are_read_as_it_reads_them():
    # vLLM validates with pydantic's lax mode: "8" is 8, true is 1, "yes" is true, "0.5" is 0.5
    body = {**COMPLETION, "max_tokens": "8", "temperature": "0.5", "stream": "yes", "echo": 1, "top_k": True}
    coerced, found = checked(body, kind="completion")
    assert found is None
    assert coerced == {**COMPLETION, "max_tokens": 8, "temperature": 0.5, "stream": True, "echo": True, "top_k": 1}
    assert body["max_tokens"] == "8"  # the client's body itself is left as sent


# --- through the gateway view ----------------------------------------------------------------------------------


@pytest.fixture
def gateway(db, redis_server, client, django_user_model):
    """An endpoint in the given mode (nothing listens at its URL: a request that passed would fail upstream)."""
    from rest_framework.authtoken.models import Token

    from speculation.services.version import bump_routing_version

    user = django_user_model.objects.create_superuser("gw-admin", password="pw-for-tests-only")
    key = Token.objects.create(user=user).key

    def make(mode: str) -> tuple[str, dict[str, str]]:
        name = f"ep-{mode}"
        endpoint = Endpoint.objects.create(name=name, base_url="http://127.0.0.1:9", status=EndpointStatus.READY)
        SpeculationPolicy.objects.update_or_create(endpoint=endpoint, defaults={"mode": mode})
        bump_routing_version()
        return name, {"HTTP_AUTHORIZATION": f"Bearer {key}"}

    return make


def _post(client, path: str, body, headers, **extra):
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **headers, **extra)


@pytest.mark.parametrize("mode", [Mode.PROD, Mode.SHADOW])
@pytest.mark.parametrize(
    "change",
    [{"temperature": "hot"}, {"temperature": [0]}, {"top_p": 0}, {"top_p": 2}, {"prompt": ""}],
    ids=["temperature-hot", "temperature-list", "top_p-0", "top_p-2", "empty-prompt"],
)
def test_prod_and_shadow_answer_a_body_the_server_refuses_with_an_openai_400(client, gateway, mode, change):
    model, headers = gateway(mode)
    response = _post(client, "/v1/completions", {**COMPLETION, "model": model, **change}, headers)
    assert response.status_code == 400
    assert response["Content-Type"] == "application/json"
    assert response[REQUEST_ID_HEADER]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == next(iter(change))
    assert next(iter(change)) in error["message"]
    assert not StageRecord.objects.exists()  # nothing was speculated or replayed


def test_off_mode_leaves_the_answer_to_the_server(client, gateway):
    model, headers = gateway(Mode.OFF)
    response = _post(client, "/v1/completions", {**COMPLETION, "model": model, "temperature": "hot"}, headers)
    # the server is down here: the gateway tried to relay instead of answering for it
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_unreachable"


def test_a_20_mb_body_gets_an_openai_shaped_error_with_the_request_id(client, gateway, settings):
    model, headers = gateway(Mode.PROD)
    body = json.dumps({**COMPLETION, "model": model, "prompt": "x" * (20 * 1024 * 1024)})
    response = _post(client, "/v1/completions", body, headers)
    assert response.status_code == 413
    assert response[REQUEST_ID_HEADER]
    assert response.json()["error"]["code"] == "request_too_large"
    assert str(settings.DATA_UPLOAD_MAX_MEMORY_SIZE) in response.json()["error"]["message"]


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"\xff\xfe", b"{", b'{"model": 1}', b"[]", b'"x"'])
def test_bodies_that_are_not_a_json_object_are_400s(client, gateway, raw):
    _, headers = gateway(Mode.PROD)
    response = _post(client, "/v1/chat/completions", raw, headers)
    assert response.status_code == 400
    assert response[REQUEST_ID_HEADER]
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_an_error_the_server_gives_to_a_shadow_stream_request_reaches_the_client_whole(client, gateway, http_stub):
    # found by the fuzz run: the shadow stream observer held back a JSON error body (no SSE event boundary)
    error = {"error": {"message": "ignore_eos: Input should be a valid boolean", "type": "BadRequestError"}}
    stub = http_stub({("POST", "/v1/completions"): lambda r: (400, {"content-type": "application/json"},
                                                             json.dumps(error).encode())})  # fmt: skip
    model, headers = gateway(Mode.SHADOW)
    Endpoint.objects.filter(name=model).update(base_url=stub.base_url)
    from speculation.services.version import bump_routing_version

    bump_routing_version()
    body = {**COMPLETION, "model": model, "stream": True, "ignore_eos": None}
    response = _post(client, "/v1/completions", body, headers)
    assert response.status_code == 400
    content = b"".join(response.streaming_content) if response.streaming else response.content
    assert json.loads(content) == error
    assert response[REQUEST_ID_HEADER]


def test_a_connection_the_server_drops_before_answering_is_sent_again(client, gateway):
    import socket
    import threading

    # given: a server that closes the first connection without a response (a keep-alive connection it closed as
    # the request went out), then answers
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    seen = []

    def serve() -> None:
        for attempt in range(2):
            conn, _ = listener.accept()
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                seen.append(data.split(b"\r\n", 1)[0])
                if attempt == 0:
                    continue  # closed: no response
                body = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": []}).encode()
                head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                conn.sendall(head.encode() + b"connection: close\r\n\r\n" + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    model, headers = gateway(Mode.OFF)
    Endpoint.objects.filter(name=model).update(base_url=f"http://127.0.0.1:{port}")
    from speculation.services.version import bump_routing_version

    bump_routing_version()
    # when
    response = _post(client, "/v1/completions", {**COMPLETION, "model": model}, headers)
    # then: the client got the server's answer, not a 502; the server saw the request twice
    thread.join(timeout=10)
    listener.close()
    assert response.status_code == 200, response.content
    assert response.json()["id"] == "cmpl-1"
    assert seen == [b"POST /v1/completions HTTP/1.1"] * 2


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.SHADOW, Mode.PROD])
def test_a_field_nested_deeper_than_the_limit_is_a_400_naming_it_in_every_mode(client, gateway, mode):
    model, headers = gateway(mode)
    deep = "[" * 500 + "]" * 500
    raw = f'{{"model": "{model}", "prompt": "x", "max_tokens": 4, "response_format": {deep}}}'
    response = _post(client, "/v1/completions", raw, headers)
    assert response.status_code == 400
    assert response[REQUEST_ID_HEADER]
    assert "nested deeper than 64 levels" in response.json()["error"]["message"]
