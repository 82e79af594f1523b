"""Worker heartbeats in Redis: which Celery workers are alive, what they consume, how many slots are busy.

Each worker's main process (the one that hands tasks to its pool) writes one field of the hash WORKERS_KEY
every INTERVAL_S: {"ts", "queues", "processes", "busy"}, where busy counts the tasks its pool is executing
(celery.worker.state.active_requests). /metrics reads the hash (one HGETALL) for worker saturation; a field
older than STALE_S belongs to a worker that died without saying so (SIGKILL) and is dropped. Cheaper than
`celery inspect` (a broadcast that waits for every worker's answer).

Connected in ace.celery, so every `celery worker` process publishes; the web process only reads.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis
from celery.signals import worker_ready, worker_shutdown

logger = logging.getLogger(__name__)

WORKERS_KEY = "ace:worker-heartbeats"
INTERVAL_S = 2.0
STALE_S = 10.0

_stop = threading.Event()
_threads: list[threading.Thread] = []


@dataclass(frozen=True)
class WorkerBeat:
    hostname: str
    queues: tuple[str, ...]
    processes: int
    busy: int
    ts: float


def beat_of(consumer: Any) -> dict[str, Any]:
    """This worker's current state, from its Consumer (the sender of worker_ready)."""
    from celery.worker import state

    queues = sorted(q.name for q in getattr(consumer.task_consumer, "queues", []) or [])
    processes = int(getattr(consumer.controller, "concurrency", 0) or getattr(consumer.pool, "num_processes", 1) or 1)
    return {"ts": time.time(), "queues": queues, "processes": processes, "busy": len(state.active_requests)}


def publish(client: redis.Redis, hostname: str, beat: dict[str, Any]) -> None:
    client.hset(WORKERS_KEY, hostname, json.dumps(beat))


def read(client: redis.Redis, *, now: float | None = None) -> list[WorkerBeat]:
    """Live workers; stale fields (a worker killed without a shutdown) are deleted on the way."""
    now = time.time() if now is None else now
    live, stale = [], []
    for raw_host, raw in client.hgetall(WORKERS_KEY).items():
        host = raw_host.decode() if isinstance(raw_host, bytes) else str(raw_host)
        try:
            data = json.loads(raw)
            beat = WorkerBeat(
                hostname=host,
                queues=tuple(data["queues"]),
                processes=int(data["processes"]),
                busy=int(data["busy"]),
                ts=float(data["ts"]),
            )
        except (ValueError, KeyError, TypeError):
            stale.append(host)
            continue
        if now - beat.ts > STALE_S:
            stale.append(host)
        else:
            live.append(beat)
    if stale:
        client.hdel(WORKERS_KEY, *stale)
    return live


def _loop(consumer: Any) -> None:
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
    hostname = consumer.hostname
    while not _stop.is_set():
        try:
            publish(client, hostname, beat_of(consumer))
        except (redis.RedisError, OSError) as exc:  # Redis restarting: the next beat tries again
            logger.debug("worker heartbeat not written: %s", exc)
        _stop.wait(INTERVAL_S)
    try:
        client.hdel(WORKERS_KEY, hostname)
    except (redis.RedisError, OSError):
        pass


@worker_ready.connect
def _start(sender: Any = None, **_: Any) -> None:
    if sender is None:
        return
    _stop.clear()
    thread = threading.Thread(target=_loop, args=(sender,), name="ace-heartbeat", daemon=True)
    thread.start()
    _threads.append(thread)


@worker_shutdown.connect
def _shutdown(**_: Any) -> None:
    """A warm shutdown removes the worker's field at once (the thread deletes it on its way out)."""
    _stop.set()
    for thread in _threads:
        thread.join(timeout=2.0)
    _threads.clear()
