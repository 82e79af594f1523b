"""The probe service: queueing a probe, running it, and what it records on the Probe and the Endpoint."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from ace.processes import free_port
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.probing import run_probe
from fleet.tasks import reprobe_all, start_probe
from tests.support.server_shapes import MODEL, openai_routes

pytestmark = pytest.mark.django_db


def make_endpoint(name: str = "ep", base_url: str = "http://127.0.0.1:9", kind: str = "openai", **fields) -> Endpoint:
    return Endpoint.objects.create(name=name, base_url=base_url, kind=kind, **fields)


def test_start_probe_creates_a_queued_probe_and_marks_a_new_endpoint_probing(django_capture_on_commit_callbacks):
    endpoint = make_endpoint()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        probe = start_probe(endpoint)
    assert probe.status == ProbeStatus.QUEUED
    assert probe.endpoint_id == endpoint.pk
    assert Endpoint.objects.get(pk=endpoint.pk).status == EndpointStatus.PROBING
    assert len(callbacks) == 1  # the task is sent only once the transaction commits


def test_start_probe_sends_the_task_to_the_control_queue_on_commit(redis_server, django_capture_on_commit_callbacks):
    broker = redis.Redis.from_url(redis_server.url)
    broker.delete(settings.CONTROL_QUEUE)
    endpoint = make_endpoint()
    with django_capture_on_commit_callbacks(execute=True):
        probe = start_probe(endpoint)
    messages = [json.loads(m) for m in broker.lrange(settings.CONTROL_QUEUE, 0, -1)]
    assert [m["headers"]["task"] for m in messages] == ["fleet.tasks.probe_endpoint_task"]
    assert messages[0]["headers"]["argsrepr"] == f"[{probe.pk}]"
    broker.delete(settings.CONTROL_QUEUE)


@pytest.fixture
def broker_down():
    """Celery pointed at a closed loopback port for one test, then back to where it was."""
    from ace.celery import app

    previous = app.conf.broker_url
    _point_celery(app, f"redis://127.0.0.1:{free_port()}/0")
    yield
    _point_celery(app, previous)


def _point_celery(app, url: str) -> None:
    app.conf.broker_url = url
    app._pool = None
    app.amqp._producer_pool = None


def test_a_probe_that_cannot_be_queued_is_recorded_as_an_error(broker_down, django_capture_on_commit_callbacks):
    endpoint = make_endpoint()
    with django_capture_on_commit_callbacks(execute=True):
        probe = start_probe(endpoint)
    probe.refresh_from_db()
    assert probe.status == ProbeStatus.DONE
    assert probe.outcome == EndpointStatus.ERROR
    assert "broker is unreachable" in probe.reason


def test_run_probe_records_a_ready_endpoint(http_stub):
    stub = http_stub(openai_routes())
    endpoint = make_endpoint(base_url=stub.base_url)
    probe = Probe.objects.create(endpoint=endpoint)
    run_probe(probe.pk)
    probe.refresh_from_db()
    endpoint.refresh_from_db()
    assert probe.status == ProbeStatus.DONE
    assert probe.outcome == EndpointStatus.READY
    assert probe.errors == []
    assert probe.capabilities["served_model"] == MODEL
    assert probe.started_at <= probe.finished_at
    assert probe.duration_ms > 0
    assert endpoint.status == EndpointStatus.READY
    assert endpoint.served_model == MODEL
    assert endpoint.capabilities == probe.capabilities
    assert endpoint.last_probed_at == probe.finished_at


def test_run_probe_records_an_unreachable_endpoint_and_keeps_its_last_capabilities():
    known = {"served_model": "old", "max_context": 1024}
    endpoint = make_endpoint(base_url=f"http://127.0.0.1:{free_port()}", capabilities=known, served_model="old")
    probe = Probe.objects.create(endpoint=endpoint)
    run_probe(probe.pk)
    probe.refresh_from_db()
    endpoint.refresh_from_db()
    assert probe.outcome == EndpointStatus.UNREACHABLE
    assert probe.reason.startswith("unreachable:") and "connection refused" in probe.reason
    assert probe.errors[0]["step"] == "models"
    assert endpoint.status == EndpointStatus.UNREACHABLE
    assert endpoint.status_reason == probe.reason
    assert endpoint.capabilities == known
    assert endpoint.served_model == "old"
    assert endpoint.last_probed_at is not None


def test_run_probe_leaves_a_finished_probe_alone():
    endpoint = make_endpoint()
    probe = Probe.objects.create(endpoint=endpoint, status=ProbeStatus.DONE, outcome=EndpointStatus.READY)
    run_probe(probe.pk)
    probe.refresh_from_db()
    assert probe.outcome == EndpointStatus.READY
    assert Endpoint.objects.get(pk=endpoint.pk).last_probed_at is None


def test_run_probe_of_a_deleted_endpoint_does_nothing():
    endpoint = make_endpoint()
    probe = Probe.objects.create(endpoint=endpoint)
    endpoint.delete()
    assert run_probe(probe.pk) is None


def test_an_api_key_that_cannot_be_decrypted_is_a_recorded_error():
    endpoint = make_endpoint(api_key_encrypted="not-a-fernet-token")
    probe = Probe.objects.create(endpoint=endpoint)
    run_probe(probe.pk)
    probe.refresh_from_db()
    assert probe.outcome == EndpointStatus.ERROR
    assert "cannot be decrypted" in probe.reason


def test_an_edit_made_while_probing_is_not_overwritten(http_stub):
    stub = http_stub(openai_routes())
    endpoint = make_endpoint(base_url=stub.base_url)
    probe = Probe.objects.create(endpoint=endpoint)
    Endpoint.objects.filter(pk=endpoint.pk).update(node_class="a100")  # an edit after the probe was queued
    run_probe(probe.pk)
    assert Endpoint.objects.get(pk=endpoint.pk).node_class == "a100"


def test_reprobe_all_queues_one_probe_per_endpoint_without_a_pending_one(django_capture_on_commit_callbacks):
    idle = make_endpoint("idle")
    busy = make_endpoint("busy")
    Probe.objects.create(endpoint=busy, status=ProbeStatus.RUNNING)
    with django_capture_on_commit_callbacks(execute=False):
        queued = reprobe_all()
    assert queued == 1
    assert idle.probes.filter(status=ProbeStatus.QUEUED).count() == 1
    assert busy.probes.count() == 1


def test_reprobe_all_closes_lost_probes_and_probes_their_endpoints_again(django_capture_on_commit_callbacks):
    endpoint = make_endpoint()
    lost = Probe.objects.create(endpoint=endpoint, status=ProbeStatus.RUNNING)
    Probe.objects.filter(pk=lost.pk).update(
        created_at=timezone.now() - timedelta(seconds=3 * settings.PROBE_INTERVAL_S)
    )
    with django_capture_on_commit_callbacks(execute=False):
        assert reprobe_all() == 1
    lost.refresh_from_db()
    assert lost.status == ProbeStatus.DONE
    assert lost.outcome == EndpointStatus.ERROR
    assert lost.reason.startswith("lost:")
    assert endpoint.probes.filter(status=ProbeStatus.QUEUED).count() == 1
