"""A prod stream whose worker fails and whose plain continuation fails too (the server is down) ends with an error
event, never with a "length" finish and [DONE] that a client would take for a complete answer (found by
manage.py fault_run: vLLM killed while the worker was killed)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from asgiref.sync import async_to_sync

from speculation.gateway.call import Call
from speculation.gateway.openai_format import Shape
from speculation.gateway.prod import ProdRun
from speculation.gateway.routes import Route
from speculation.gateway.sampling import RequestSampling
from speculation.gateway.sse import DONE
from speculation.jobs.channel import Error, Tokens
from speculation.models import Action, StageRecord


class FailingChannel:
    """The worker sends two tokens, then reports a failure."""

    def __init__(self) -> None:
        self.messages = [
            Tokens(ids=[5, 6], text="ab"),
            Error(reason="worker died"),
        ]  # as the gateway's channel reads them

    async def receive(self, timeout_s: float):
        return self.messages.pop(0)

    async def discard(self) -> None:
        return None


@pytest.fixture
def server_answering(request):
    """A loopback HTTP server answering every request with the given status and a JSON error body."""
    status = request.param
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                body = b'{"error": {"message": "down"}}'
                conn.sendall(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    "connection: close\r\n\r\n".encode()
                    + body
                )

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def _run(base_url: str, endpoint_id: int) -> list[bytes]:
    route = Route(
        endpoint_id=endpoint_id, name="e", base_url=base_url, kind="vllm", node_class="cpu", served_model="m",
        api_key="", status="ready", capabilities={}, mode="prod", path="local",
    )  # fmt: skip
    body = {"model": "e", "prompt": "x", "max_tokens": 8, "stream": True}
    call = Call(route=route, kind="completion", body=body, raw=json.dumps(body).encode(), request_id="unfinished-1")
    run = ProdRun(
        call=call,
        channel=FailingChannel(),
        shape=Shape(kind="completion", request_id="unfinished-1", model="e", prompt_ids=[1, 2]),
        prompt_ids=[1, 2],
        max_tokens=8,
        sampling=RequestSampling(temperature=0.0, top_k=0, top_p=1.0, seed=None),
    )

    async def collect() -> list[bytes]:
        pieces = [piece async for piece in run.stream()]
        # the record is written by a background task of this loop: let it run before the loop ends
        for _ in range(100):
            if await StageRecord.objects.filter(request_id="unfinished-1").aexists():
                break
            await asyncio.sleep(0.05)
        return pieces

    return async_to_sync(collect)()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("server_answering", [503], indirect=True)
def test_worker_and_server_both_failing_end_the_stream_with_an_error_not_a_finish(server_answering, redis_server):
    from fleet.models import Endpoint

    endpoint = Endpoint.objects.create(name="unfinished", base_url=server_answering, status="ready")
    # when the worker fails after two tokens and the server answers the plain continuation with 503
    pieces = _run(server_answering, endpoint.pk)
    # then the tokens already sent stay, the stream ends with an error event, and there is no finish or [DONE]
    text = b"".join(pieces)
    assert b'"ab"' in text
    assert pieces[-1].startswith(b"data: {") and b"generation_unfinished" in pieces[-1]
    assert DONE not in pieces
    assert b'"finish_reason": "length"' not in text and b'"finish_reason":"length"' not in text
    # and the record says what happened
    record = StageRecord.objects.get(request_id="unfinished-1")
    assert record.action == Action.FELL_BACK
    assert "worker died" in record.reason and "HTTP 503" in record.reason
