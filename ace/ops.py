"""Operations endpoints: /healthz (the process answers), /readyz (database and Redis reachable), /metrics.

/metrics is Prometheus text format (prometheus_client): the stage's counters and histograms
(speculation.selectors.metrics; summed over every process in multiprocess mode) plus gauges read at scrape time from
Redis: queue depth per Celery queue, worker saturation from the workers' heartbeats (ace.heartbeat) and prod slots
(speculation.jobs.admission: declared capacity, jobs admitted).
It is served to loopback clients (ACE_METRICS_LOOPBACK) and to `Authorization: Bearer <ACE_METRICS_TOKEN>`.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Iterator

import redis
import redis.asyncio as aioredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.decorators import login_not_required
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from ace import heartbeat
from ace.celery import gpu_queue, node_class_of
from speculation.jobs import admission
from speculation.selectors import metrics as stage_metrics

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0
# kombu's Redis transport keeps priorities 3, 6 and 9 of a queue in lists named queue + "\x06\x16" + priority.
PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")


# --- /healthz and /readyz ------------------------------------------------------------------------------------


@login_not_required
async def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"status": "ok"})


def _database_ok() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


async def _check(name: str, check: Callable[[], Awaitable[None]]) -> dict:
    try:
        await asyncio.wait_for(check(), timeout=CHECK_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the check failed; the type is reported, no details
        error = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
        logger.warning("readyz: %s check failed: %s", name, error)
        return {"ok": False, "error": error}
    return {"ok": True}


async def _redis_ok() -> None:
    client = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        await client.ping()
    finally:
        await client.aclose()


@login_not_required
async def readyz(request: HttpRequest) -> JsonResponse:
    """200 when the database and Redis answer; 503 naming the ones that did not (no addresses, no secrets)."""
    database, redis_check = await asyncio.gather(
        _check("database", sync_to_async(_database_ok, thread_sensitive=True)), _check("redis", _redis_ok)
    )
    checks = {"database": database, "redis": redis_check}
    failed = [name for name, result in checks.items() if not result["ok"]]
    return JsonResponse(
        {"status": "not ready" if failed else "ready", "failed": failed, "checks": checks},
        status=503 if failed else 200,
    )


# --- /metrics --------------------------------------------------------------------------------------------------


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def metrics_denied(request: HttpRequest) -> HttpResponse | None:
    """None when the caller may read /metrics; else the 401/403 to send."""
    token = settings.METRICS_TOKEN
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if token and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
        return None
    if settings.METRICS_ALLOW_LOOPBACK and _loopback(request.META.get("REMOTE_ADDR", "")):
        return None
    if token:
        response = JsonResponse({"error": "/metrics needs Authorization: Bearer <ACE_METRICS_TOKEN>."}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="ace-metrics"'
        return response
    return JsonResponse(
        {"error": "/metrics is served to loopback clients only; set ACE_METRICS_TOKEN to scrape it from elsewhere."},
        status=403,
    )


class QueueCollector:
    """Gauges read from Redis at scrape time: queue depth, live workers, busy worker processes, saturation."""

    def __init__(self, queues: Iterable[str]) -> None:
        self.queues = set(queues)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("ace_redis_up", "1 when /metrics could read Redis (queues, worker heartbeats).")
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.5, socket_timeout=1.0)
        try:
            beats = heartbeat.read(client)
            queues = sorted(self.queues | {q for beat in beats for q in beat.queues})
            now = float(client.time()[0])  # Redis's clock, as the admission scripts use
            pipe = client.pipeline(transaction=False)
            for queue in queues:
                for suffix in PRIORITY_SUFFIXES:
                    pipe.llen(queue + suffix)
            node_classes = [c for c in map(node_class_of, queues) if c is not None]
            for node_class in node_classes:
                pipe.zrangebyscore(admission.workers_key(node_class), now, "+inf")
                pipe.zcount(admission.inflight_key(node_class), now, "+inf")
            answers = pipe.execute()
            width = len(PRIORITY_SUFFIXES)
            lengths, slot_answers = answers[: len(queues) * width], answers[len(queues) * width :]
        except (redis.RedisError, OSError) as exc:
            logger.warning("/metrics: Redis unreadable: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        finally:
            client.close()
        up.add_metric([], 1)
        yield up
        depth = GaugeMetricFamily(
            "ace_queue_depth", "Tasks waiting in a Celery queue (gpu.<node class>: prod and shadow).", labels=["queue"]
        )
        workers = GaugeMetricFamily(
            "ace_worker_processes",
            "Worker processes (pool slots) of live workers consuming the queue.",
            labels=["queue"],
        )
        busy = GaugeMetricFamily(
            "ace_worker_busy",
            "Worker processes executing a task, of live workers consuming the queue.",
            labels=["queue"],
        )
        saturation = GaugeMetricFamily(
            "ace_worker_saturation",
            "ace_worker_busy / ace_worker_processes (absent while no worker is live).",
            labels=["queue"],
        )
        for index, queue in enumerate(queues):
            depth.add_metric([queue], sum(lengths[index * width : (index + 1) * width]))
            mine = [beat for beat in beats if queue in beat.queues]
            slots, active = sum(b.processes for b in mine), sum(min(b.busy, b.processes) for b in mine)
            workers.add_metric([queue], slots)
            busy.add_metric([queue], active)
            if slots:
                saturation.add_metric([queue], active / slots)
        yield from (depth, workers, busy, saturation)
        slots = GaugeMetricFamily(
            "ace_prod_slots",
            "Prod jobs the live GPU workers of a node class run at once (admission).",
            labels=["queue"],
        )
        in_use = GaugeMetricFamily(
            "ace_prod_slots_in_use",
            "Prod jobs admitted and not finished (a request finding none free goes plain).",
            labels=["queue"],
        )
        for index, node_class in enumerate(node_classes):
            members, admitted = slot_answers[2 * index], slot_answers[2 * index + 1]
            slots.add_metric([f"gpu.{node_class}"], sum(_declared(m) for m in members))
            in_use.add_metric([f"gpu.{node_class}"], int(admitted))
        yield from (slots, in_use)


def _declared(member: bytes | str) -> int:
    """The concurrency a worker declared in its admission member "<hostname>|<concurrency>"."""
    text = member.decode() if isinstance(member, bytes) else member
    tail = text.rsplit("|", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class _Registered:
    """A registry's metrics, as a collector of another registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        return self.registry.collect()


def multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))


def render(queues: Iterable[str]) -> bytes:
    registry = CollectorRegistry()
    if multiprocess():
        MultiProcessCollector(registry)
    else:
        registry.register(_Registered(stage_metrics.REGISTRY))
    registry.register(QueueCollector(queues))
    return generate_latest(registry)


async def _known_queues() -> set[str]:
    queues = {settings.CONTROL_QUEUE, gpu_queue(settings.DEFAULT_NODE_CLASS)}
    try:
        from speculation.gateway.routes import route_cache

        queues |= {gpu_queue(route.node_class) for route in (await route_cache().table()).values()}
    except Exception as exc:  # noqa: BLE001 - the database may be down; the default queues are still reported
        logger.warning("/metrics: endpoint node classes unreadable: %s", type(exc).__name__)
    return queues


@login_not_required
async def metrics(request: HttpRequest) -> HttpResponse:
    denied = metrics_denied(request)
    if denied is not None:
        return denied
    body = await asyncio.to_thread(render, await _known_queues())
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
