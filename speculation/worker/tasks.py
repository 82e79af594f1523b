"""Celery tasks of the speculation stage. Thin: they call services.

On the endpoint's GPU node queue gpu.<class>: prod generation and shadow measurement. On its background queue
gpu.<class>.background (ace.celery; the same workers consume it): cost calibrations and auto-pairing's candidate
replays, work that may take minutes on a loaded node. A background task yields to foreground work: while jobs wait
on gpu.<class> it goes back on its queue, for BACKGROUND_DEFER_S and then twice as long each time up to
MAX_DEFER_S, at most MAX_DEFERS times (so it is delayed by under three minutes, never starved). The growing wait
keeps the deferrals themselves from taking CPU from prod: each one is a task run, a Redis read and a requeue in
the worker process that serves prod's requests.
Models are loaded once per worker process and kept (speculation.worker.paths.resources).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task
from celery.signals import worker_process_init, worker_ready, worker_shutdown

from ace.celery import background_queue, gpu_queue, node_class_of
from speculation.jobs import queue
from speculation.jobs.job import ProdJob, ShadowJob

logger = logging.getLogger(__name__)


@worker_process_init.connect
def _preload(**_: Any) -> None:
    """Import torch and transformers once per worker process, before any request waits on them, with the worker's
    OpenMP settings (speculation.worker.openmp: idle threads spin briefly, and a process that batches on a CPU keeps
    its one OpenMP team in the batch loop's thread)."""
    from speculation.worker import openmp

    def imports() -> None:
        import speculation.worker.generation  # noqa: F401
        import speculation.worker.shadow  # noqa: F401

    openmp.load_torch(imports)


_heartbeat: Any = None


@worker_ready.connect
def _declare_capacity(sender: Any = None, **_: Any) -> None:
    """Declare how many prod jobs this worker runs at once, per GPU node class it consumes (admission control)."""
    global _heartbeat
    from django.conf import settings

    from speculation.jobs.admission import CapacityHeartbeat

    queues = list(sender.app.amqp.queues.consume_from or {})
    node_classes = [c for c in map(node_class_of, queues) if c is not None]
    if not node_classes:
        return
    from speculation.worker import batching

    processes = int(getattr(sender.controller, "concurrency", 1) or 1)
    _heartbeat = CapacityHeartbeat(
        redis_url=settings.REDIS_URL,
        node_classes=node_classes,
        member=sender.hostname,
        concurrency=batching.capacity(processes),  # batch slots
        single=processes if batching.enabled() else 0,  # remote-path and EAGLE jobs: one at a time per process
    )
    _heartbeat.start()


@worker_shutdown.connect
def _withdraw_capacity(**_: Any) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()


@shared_task(name=queue.PROD_TASK, acks_late=False, ignore_result=True)
def prod_generate_task(wire: dict[str, Any]) -> None:
    # acks_late off: a prod request redelivered after a worker crash would generate into a channel the gateway
    # already gave up on (it fell back).
    from speculation.jobs.channel import announce_started

    job = ProdJob.from_dict(wire)  # refuses a job this code does not read, naming the field
    announce_started(job.request_id)  # before any heavy import: the gateway's start timeout is short
    from speculation.worker import batching
    from speculation.worker.generation import run_prod_generation

    if batching.takes(wire):  # the process's batch loop serves it: this process takes the next job at once
        batching.hand_off(wire, run_prod_generation)
        return
    with batching.single_stream():
        run_prod_generation(job)


@shared_task(name=queue.SHADOW_TASK, acks_late=True, ignore_result=True)
def shadow_measure_task(**kwargs: Any) -> None:
    from speculation.worker.batching import single_stream
    from speculation.worker.shadow import measure_shadow

    with single_stream():  # it uses the loaded models' own KV caches
        measure_shadow(**ShadowJob.from_dict(kwargs).to_dict())


BACKGROUND_DEFER_S = 2.0
MAX_DEFER_S = 16.0
MAX_DEFERS = 12  # 2 + 4 + 8 + 9 x 16 s: 158 s at most


def defer_s(defers: int) -> float:
    """How long a background task waits before its next try, after `defers` deferrals."""
    return min(BACKGROUND_DEFER_S * 2 ** min(defers, 8), MAX_DEFER_S)


def _foreground_waiting(node_class: str) -> bool:
    """Whether prod or shadow jobs wait on the node class's queue (kombu keeps a Redis list per queue), or prod jobs
    run on it (admitted and in flight: a batching worker takes them off the queue at once). Why: candidate replays
    queued by shadow that run beside prod's requests slow prod to as little as a third of its rate."""
    import redis
    from django.conf import settings

    from speculation.jobs.admission import foreground_jobs

    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
        return foreground_jobs(client, node_class=node_class, queue=gpu_queue(node_class)) > 0
    except (redis.RedisError, OSError):
        return False


def _deferred(task: Any, *, node_class: str, defers: int, kwargs: dict[str, Any]) -> bool:
    """Put a background task back on its queue for a moment while foreground work waits; True when it did."""
    if defers >= MAX_DEFERS or not _foreground_waiting(node_class):
        return False
    _requeue(task, node_class=node_class, defers=defers, kwargs=kwargs)
    return True


def _requeue(task: Any, *, node_class: str, defers: int, kwargs: dict[str, Any]) -> None:
    task.apply_async(
        kwargs={**kwargs, "node_class": node_class, "defers": defers + 1},
        queue=background_queue(node_class),
        countdown=defer_s(defers),
        retry=False,
    )


@shared_task(name=queue.CALIBRATION_TASK, bind=True, acks_late=True, ignore_result=True)
def calibrate_costs_task(self: Any, *, node_class: str, defers: int = 0, **kwargs: Any) -> None:
    """One cost calibration (speculation.worker.costs.calibrate), deduplicated across workers by a Redis lock."""
    if _deferred(self, node_class=node_class, defers=defers, kwargs=kwargs):
        return
    from speculation.worker.batching import single_stream
    from speculation.worker.costs import CalibrationError, Preempted, calibrate, preemptible

    # between two timings it gives way to prod and shadow jobs that arrive meanwhile (after MAX_DEFERS it finishes)
    waiting = (lambda: _foreground_waiting(node_class)) if defers < MAX_DEFERS else (lambda: False)
    try:
        with single_stream(), preemptible(waiting):  # single_stream: the loaded models' own KV caches
            calibrate(**kwargs)
    except Preempted:
        logger.info(
            "cost calibration of endpoint %s (%s) gave way to waiting jobs", kwargs.get("endpoint_id"), node_class
        )
        _requeue(self, node_class=node_class, defers=defers, kwargs=kwargs)
    except CalibrationError as exc:
        logger.warning("cost calibration of endpoint %s (%s) failed: %s", kwargs.get("endpoint_id"), node_class, exc)


@shared_task(name=queue.CANDIDATES_TASK, bind=True, acks_late=True, ignore_result=True)
def replay_candidates_task(self: Any, *, node_class: str, defers: int = 0, **kwargs: Any) -> None:
    """Every compatible candidate replayed on one shadowed request (speculation.worker.candidates)."""
    if _deferred(self, node_class=node_class, defers=defers, kwargs=kwargs):
        return
    from speculation.worker.batching import single_stream
    from speculation.worker.candidates import replay_candidates_for_request

    with single_stream():
        replay_candidates_for_request(**kwargs)


# register the EAGLE training task with the worker (autodiscovery finds `tasks` modules only)
from speculation.worker.tasks_eagle import train_eagle_head_task  # noqa: E402, F401


@shared_task(name="speculation.tasks.refresh_rollups_task", ignore_result=True)
def refresh_rollups_task() -> int:
    """Beat runs this on the control queue every minute, so the charts' per-minute rollups stay filled even
    when no page is viewed (a page view still rolls up what is missing first)."""
    from speculation.selectors.rollup_store import refresh_rollups

    return refresh_rollups()


@shared_task(name="speculation.tasks.retrain_from_captures_task", ignore_result=True)
def retrain_from_captures_task() -> int:
    """Beat runs this on the control queue every hour: a finished run on an endpoint's captured traffic is queued
    again once enough new traffic was captured (speculation.services.capture_retraining)."""
    from speculation.services.capture_retraining import retrain_due

    return len(retrain_due())


@shared_task(name="speculation.tasks.prune_records_task", ignore_result=True)
def prune_records_task() -> int:
    """Beat runs this on the control queue every 10 minutes: raw stage records past ACE_RECORD_RETENTION are
    deleted in small batches, per-minute rollups past ACE_ROLLUP_RETENTION merged into hours, captured requests
    past their endpoint's retention or size cap deleted."""
    from speculation.services.records_retention import prune

    return prune().records
