"""The old instance of a switch drains before it stops: only once its server has reported no request for the quiet
time (vLLM counts a request from its first engine step, so an idle reading may hide one it just accepted), and a
/metrics read that fails (a loaded server answering slowly) is never taken for an idle server."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from fleet.managed import supervisor as supervisor_module
from fleet.managed.models import InstanceRole, InstanceState, ServerInstance
from fleet.managed.supervisor import Supervisor

pytestmark = pytest.mark.django_db


class Gauges:
    """What the fake server's /metrics says, and how long it takes to say it."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.delay_s = 0.0


@pytest.fixture
def metrics_server():
    gauges = Gauges()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            time.sleep(gauges.delay_s)
            body = (
                f'vllm:num_requests_running{{engine="0"}} {gauges.in_flight}.0\n'
                'vllm:num_requests_waiting{engine="0"} 0.0\n'
            ).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except BrokenPipeError:
                pass  # the reader gave up waiting

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield gauges, server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def draining(managed_endpoint, serving, metrics_server):
    """The endpoint's old instance, on the fake server, routed away 5 s ago (past the grace)."""
    gauges, port = metrics_server
    old = serving(managed_endpoint, port=port)
    ServerInstance.objects.filter(pk=old.pk).update(
        role=InstanceRole.DRAINING, draining_since=timezone.now() - timedelta(seconds=5)
    )
    old.refresh_from_db()
    return old, gauges


def _state(instance: ServerInstance) -> str:
    instance.refresh_from_db()
    return instance.state


def test_it_stops_the_old_instance_only_after_the_quiet_time_without_requests(draining, monkeypatch):
    monkeypatch.setattr(supervisor_module, "DRAIN_QUIET_S", 0.5)
    old, gauges = draining
    supervisor = Supervisor(node_class="cpu")

    supervisor._drain(old)  # idle now, but a request accepted a moment ago may not be counted yet
    assert _state(old) == InstanceState.READY
    gauges.in_flight = 1  # it was: the quiet time starts again once it ends
    time.sleep(0.6)
    supervisor._drain(old)
    assert _state(old) == InstanceState.READY
    gauges.in_flight = 0
    supervisor._drain(old)
    assert _state(old) == InstanceState.READY
    time.sleep(0.6)
    supervisor._drain(old)

    assert _state(old) == InstanceState.STOPPED and old.reason == "drained"


def test_a_server_that_does_not_answer_its_metrics_in_time_is_not_taken_for_idle(draining, monkeypatch):
    monkeypatch.setattr(supervisor_module, "DRAIN_QUIET_S", 0.0)
    monkeypatch.setattr(supervisor_module, "IN_FLIGHT_TIMEOUT_S", 0.2)
    old, gauges = draining
    gauges.delay_s = 1.0  # loaded: streams still running on it
    supervisor = Supervisor(node_class="cpu")

    supervisor._drain(old)
    supervisor._drain(old)

    assert _state(old) == InstanceState.READY
    gauges.delay_s = 0.0
    supervisor._drain(old)
    supervisor._drain(old)
    assert _state(old) == InstanceState.STOPPED


def test_a_drain_that_never_reads_ends_at_the_timeout_saying_so(draining, monkeypatch):
    monkeypatch.setattr(supervisor_module, "IN_FLIGHT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(supervisor_module, "DRAIN_TIMEOUT_S", 4.0)  # routed away 5 s ago
    old, gauges = draining
    gauges.delay_s = 1.0

    Supervisor(node_class="cpu")._drain(old)

    assert _state(old) == InstanceState.STOPPED
    assert old.reason == "drain timeout (its requests in flight could not be read)"
