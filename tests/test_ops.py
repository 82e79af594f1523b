"""/healthz, /readyz and /metrics (ace.ops): who may read the metrics, what readiness reports, and the gauges
read from Redis (queue depth, worker saturation from the workers' heartbeats)."""

from __future__ import annotations

import json
import time

import pytest

from ace import heartbeat, processes
from tests.support.prometheus import samples


@pytest.fixture
def redis_url(redis_server, settings):
    settings.REDIS_URL = redis_server.url
    import redis

    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield redis_server.url
    client.flushdb()


def test_healthz_answers_without_signing_in(client):
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


@pytest.mark.django_db
def test_readyz_is_ready_when_the_database_and_redis_answer(client, redis_url):
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["status"] == "ready"
    assert body["failed"] == []
    assert body["checks"] == {"database": {"ok": True}, "redis": {"ok": True}}


@pytest.mark.django_db
def test_readyz_says_503_and_names_redis_when_redis_is_down(client, settings):
    # given: a Redis URL where nothing listens (a port just freed), with a password that must not leak
    settings.REDIS_URL = f"redis://:secret-password@127.0.0.1:{processes.free_port()}/0"
    # when
    response = client.get("/readyz")
    # then
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not ready"
    assert body["failed"] == ["redis"]
    assert body["checks"]["database"] == {"ok": True}
    assert body["checks"]["redis"]["ok"] is False
    assert "secret-password" not in response.content.decode()
    assert "127.0.0.1" not in response.content.decode()


@pytest.mark.django_db
def test_readyz_says_503_and_names_the_database_when_it_fails(client, redis_url, monkeypatch):
    from django.db import OperationalError

    from ace import ops

    def broken() -> None:
        raise OperationalError("could not connect to server: password authentication failed for user ace")

    monkeypatch.setattr(ops, "_database_ok", broken)
    response = client.get("/readyz")
    assert response.status_code == 503
    assert response.json()["failed"] == ["database"]
    assert response.json()["checks"]["database"] == {"ok": False, "error": "OperationalError"}
    assert "password" not in response.content.decode()


@pytest.mark.django_db
def test_readyz_stops_redis_for_real_and_recovers(client, settings, tmp_path):
    own = processes.start_redis(workdir=tmp_path / "redis", log_dir=tmp_path)
    settings.REDIS_URL = own.url
    try:
        assert client.get("/readyz").status_code == 200
        own.stop()
        assert client.get("/readyz").status_code == 503
        again = processes.start_redis(workdir=tmp_path / "redis", log_dir=tmp_path, port=own.extra["port"])
        try:
            assert client.get("/readyz").status_code == 200
        finally:
            again.stop()
    finally:
        own.stop()


@pytest.mark.django_db
def test_metrics_are_served_to_loopback_clients(client, redis_url):
    response = client.get("/metrics", REMOTE_ADDR="127.0.0.1")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert "ace_redis_up 1.0" in response.content.decode()


@pytest.mark.django_db
def test_metrics_refuse_other_addresses_when_no_token_is_set(client, redis_url, settings):
    settings.METRICS_TOKEN = ""
    response = client.get("/metrics", REMOTE_ADDR="10.1.2.3")
    assert response.status_code == 403
    assert "ACE_METRICS_TOKEN" in response.json()["error"]
    assert b"ace_requests" not in response.content


@pytest.mark.django_db
def test_metrics_take_the_bearer_token_from_anywhere_and_refuse_a_wrong_one(client, redis_url, settings):
    settings.METRICS_TOKEN = "a-long-metrics-token-for-tests"
    right = client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer a-long-metrics-token-for-tests")
    wrong = client.get("/metrics", REMOTE_ADDR="10.1.2.3", HTTP_AUTHORIZATION="Bearer a-long-metrics-token-for-test")
    missing = client.get("/metrics", REMOTE_ADDR="10.1.2.3")
    assert right.status_code == 200
    assert wrong.status_code == 401
    assert missing.status_code == 401
    assert wrong["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.django_db
def test_loopback_can_be_refused_too(client, redis_url, settings):
    settings.METRICS_TOKEN = "a-long-metrics-token-for-tests"
    settings.METRICS_ALLOW_LOOPBACK = False
    assert client.get("/metrics", REMOTE_ADDR="127.0.0.1").status_code == 401
    ok = client.get("/metrics", REMOTE_ADDR="127.0.0.1", HTTP_AUTHORIZATION="Bearer a-long-metrics-token-for-tests")
    assert ok.status_code == 200


@pytest.mark.django_db
def test_queue_depth_and_worker_saturation_come_from_redis(client, redis_url):
    import redis

    r = redis.Redis.from_url(redis_url)
    # given: three tasks waiting on gpu.cpu (one at a kombu priority), a live worker with 1 of 2 slots busy,
    # and a worker that was SIGKILLed a minute ago (its heartbeat went stale)
    r.lpush("gpu.cpu", "a", "b")
    r.lpush("gpu.cpu\x06\x166", "c")
    now = time.time()
    r.lpush("gpu.cpu.background", "d")  # a calibration waiting: its own depth, not a node class of its own
    queues = ["control", "gpu.cpu", "gpu.cpu.background"]
    heartbeat.publish(r, "live@host", {"ts": now, "queues": queues, "processes": 2, "busy": 1})
    heartbeat.publish(r, "dead@host", {"ts": now - 60, "queues": ["gpu.cpu"], "processes": 4, "busy": 4})
    # when
    found = samples(client.get("/metrics").content.decode())
    # then
    assert found[("ace_queue_depth", (("queue", "gpu.cpu"),))] == 3
    assert found[("ace_queue_depth", (("queue", "control"),))] == 0
    assert found[("ace_queue_depth", (("queue", "gpu.cpu.background"),))] == 1
    assert not [key for key in found if key[0] == "ace_prod_slots" and "background" in str(key[1])]
    assert found[("ace_worker_processes", (("queue", "gpu.cpu"),))] == 2
    assert found[("ace_worker_busy", (("queue", "gpu.cpu"),))] == 1
    assert found[("ace_worker_saturation", (("queue", "gpu.cpu"),))] == 0.5
    assert r.hexists(heartbeat.WORKERS_KEY, "dead@host") is False  # dropped on the way


@pytest.mark.django_db
def test_prod_slots_come_from_admission_and_skip_expired_members(client, redis_url):
    import redis

    from speculation.jobs import admission

    r = redis.Redis.from_url(redis_url)
    now = float(r.time()[0])
    r.zadd(admission.workers_key("cpu"), {"w1@host|2": now + 30, "dead@host|4": now - 5})
    r.zadd(admission.inflight_key("cpu"), {"request-1": now + 30, "expired": now - 1})
    found = samples(client.get("/metrics").content.decode())
    assert found[("ace_prod_slots", (("queue", "gpu.cpu"),))] == 2
    assert found[("ace_prod_slots_in_use", (("queue", "gpu.cpu"),))] == 1


@pytest.mark.django_db
def test_metrics_still_answer_when_redis_is_down(client, settings):
    settings.REDIS_URL = f"redis://127.0.0.1:{processes.free_port()}/0"
    response = client.get("/metrics")
    assert response.status_code == 200
    found = samples(response.content.decode())
    assert found[("ace_redis_up", ())] == 0
    assert not any(name == "ace_queue_depth" for name, _ in found)


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_publishes_its_heartbeat(celery_worker, redis_server):
    import redis

    r = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 30
    beats = []
    while time.monotonic() < deadline and not beats:
        beats = [b for b in heartbeat.read(r) if "gpu.cpu" in b.queues]
        time.sleep(0.5)
    assert beats, r.hgetall(heartbeat.WORKERS_KEY)
    assert beats[0].processes >= 1
    assert 0 <= beats[0].busy <= beats[0].processes
    # started with -Q control,gpu.cpu: it consumes the node class's background queue too (ace.celery)
    queues = json.loads(r.hget(heartbeat.WORKERS_KEY, beats[0].hostname))["queues"]
    assert queues == ["control", "gpu.cpu", "gpu.cpu.background"]
