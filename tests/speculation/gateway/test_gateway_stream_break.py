"""An endpoint whose stream breaks off mid-response (the server killed): the client gets an error event, not a
stream that just stops and could pass for complete (found by manage.py fault_run, vLLM SIGKILLed)."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

MODEL = "breaking-model"
CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]}\n\n'


@pytest.fixture
def breaking_server():
    """A loopback HTTP server that starts a chunked event stream, sends one event and closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    + f"{len(CHUNK):x}\r\n".encode()
                    + CHUNK
                    + b"\r\n"
                )

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


@pytest.mark.django_db
def test_a_stream_that_breaks_off_ends_with_an_error_event(breaking_server, django_user_model, redis_server):
    from rest_framework.authtoken.models import Token

    from fleet.models import Endpoint

    admin = django_user_model.objects.create_superuser(username="stream-admin", password="pw-for-tests-only")
    token = Token.objects.create(user=admin).key
    Endpoint.objects.create(name="breaking", base_url=breaking_server, served_model=MODEL, status="ready")

    async def stream() -> tuple[int, str]:
        # Request and read in one event loop: the relay's upstream stream belongs to it.
        response = await AsyncClient().post(
            "/v1/chat/completions",
            data={"model": "breaking", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        return response.status_code, b"".join([chunk async for chunk in response.streaming_content]).decode()

    status, body = async_to_sync(stream)()
    assert status == 200
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["content"] == "Hel"  # what came is relayed untouched
    error = json.loads(events[-1])["error"]
    assert error["code"] == "upstream_stream_broken"
    assert "[DONE]" not in body
