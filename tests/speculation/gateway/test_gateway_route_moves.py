"""A request goes where its endpoint is routed when it is sent: a managed endpoint's blue/green switch moves it to a
new instance and stops the old one once drained, so a request that looked its route up just before the move (the
native path reads the server's counters first), or in a process that has not heard of the move yet (the old instance
refuses the connection), is sent to the new instance instead of being lost."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.test import AsyncClient

from fleet.models import Endpoint
from speculation.gateway import native
from speculation.models import SpeculationPolicy
from speculation.services.policies import get_policy
from speculation.services.version import bump_routing_version

pytestmark = pytest.mark.django_db

MODEL = "moving-model"


class Instance:
    """A loopback model server that answers every completion with a whole stream, counting what it served."""

    def __init__(self, text: str) -> None:
        self.hits: Counter[str] = Counter()
        event = {"choices": [{"index": 0, "text": text, "finish_reason": "length"}]}
        body = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        hits, self.connections = self.hits, []
        connections = self.connections

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: the gateway's pool reuses its connections

            def setup(self) -> None:
                super().setup()
                connections.append(self.connection)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hits[self.path] += 1
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """As a server process ends: no more connections, and those open are closed."""
        self.server.shutdown()
        self.server.server_close()
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def instances():
    old, new = Instance(" old"), Instance(" new")
    yield old, new
    for instance in (old, new):
        instance.stop()


@pytest.fixture
def token(django_user_model) -> str:
    from rest_framework.authtoken.models import Token

    admin = django_user_model.objects.create_superuser(username="moves-admin", password="pw-for-tests-only")
    return Token.objects.create(user=admin).key


def _endpoint(base_url: str, **policy) -> Endpoint:
    endpoint = Endpoint.objects.create(
        name="moving",
        base_url=base_url,
        served_model=MODEL,
        status="ready",
        capabilities={"native_speculation": True},
    )
    get_policy(endpoint=endpoint)
    SpeculationPolicy.objects.filter(endpoint=endpoint).update(**policy)
    bump_routing_version()
    return endpoint


async def _complete(token: str) -> tuple[int, str]:
    response = await AsyncClient().post(
        "/v1/completions",
        data={"model": "moving", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0, "stream": True},
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    if not response.streaming:
        return response.status_code, response.content.decode()
    return response.status_code, b"".join([chunk async for chunk in response.streaming_content]).decode()


def test_a_request_whose_endpoint_moves_while_the_native_path_reads_counters_goes_to_the_new_instance(
    redis_server, instances, token, monkeypatch
):
    old, new = instances
    endpoint = _endpoint(old.url, mode="prod", mechanism="ngram", path="native", k=3)

    def switch() -> None:  # what the supervisor's route move does (fleet.managed.switching._route_to)
        Endpoint.objects.filter(pk=endpoint.pk).update(base_url=new.url)
        bump_routing_version()

    async def counters_while_switching(call):
        if call.route.base_url == old.url:
            await sync_to_async(switch)()
        return None

    monkeypatch.setattr(native, "scrape", counters_while_switching)

    status, body = async_to_sync(_complete)(token)

    assert status == 200 and body.endswith("data: [DONE]\n\n") and " new" in body
    assert old.hits["/v1/completions"] == 0 and new.hits["/v1/completions"] == 1


def test_a_request_refused_by_a_stopped_instance_goes_where_the_endpoint_moved(redis_server, instances, token):
    old, new = instances
    endpoint = _endpoint(old.url)

    async def requests() -> list[tuple[int, str]]:
        # One event loop: its routing table learns the route once, then is not told of the move (no version bump:
        # the bump has not reached this process yet) while the old instance stops, as after a drain.
        first = await _complete(token)
        await sync_to_async(Endpoint.objects.filter(pk=endpoint.pk).update)(base_url=new.url)
        old.stop()
        return [first, await _complete(token)]

    (first, second) = async_to_sync(requests)()

    assert first[0] == 200 and " old" in first[1]
    assert second[0] == 200 and second[1].endswith("data: [DONE]\n\n") and " new" in second[1], second
    assert new.hits["/v1/completions"] == 1


@pytest.mark.parametrize("mode", ["off", "prod"])
def test_a_managed_endpoint_before_its_first_server_serves_answers_503_with_retry_after(redis_server, token, mode):
    from fleet.managed.models import NOT_STARTED_URL

    _endpoint(NOT_STARTED_URL, mode=mode, mechanism="ngram", path="native", k=3)
    response = async_to_sync(AsyncClient().post)(
        "/v1/completions",
        data={"model": "moving", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0},
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )
    assert response.status_code == 503 and response["Retry-After"] == "10"
    error = json.loads(response.content)["error"]
    assert error["code"] == "upstream_starting" and "managed server is starting" in error["message"]
