"""Celery tasks of the speculation stage, on the endpoint's GPU node queue. Thin: they call services.

Models are loaded once per worker process and kept (speculation.worker.paths.resources).
"""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_process_init, worker_ready, worker_shutdown

from ace.celery import gpu_queue


@worker_process_init.connect
def _preload(**_: Any) -> None:
    """Import torch and transformers once per worker process, before any request waits on them."""
    import speculation.worker.generation  # noqa: F401
    import speculation.worker.shadow  # noqa: F401


_heartbeat: Any = None


@worker_ready.connect
def _declare_capacity(sender: Any = None, **_: Any) -> None:
    """Declare how many prod jobs this worker runs at once, per GPU node class it consumes (admission control)."""
    global _heartbeat
    from django.conf import settings

    from speculation.jobs.admission import CapacityHeartbeat

    queues = list(sender.app.amqp.queues.consume_from or {})
    node_classes = [q.removeprefix("gpu.") for q in queues if q.startswith("gpu.")]
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


@shared_task(name="speculation.tasks.prod_generate_task", acks_late=False, ignore_result=True)
def prod_generate_task(job: dict[str, Any]) -> None:
    # acks_late off: a prod request redelivered after a worker crash would generate into a channel the gateway
    # already gave up on (it fell back).
    from speculation.jobs.channel import announce_started

    announce_started(job["request_id"])  # before any heavy import: the gateway's start timeout is short
    from speculation.worker import batching
    from speculation.worker.generation import run_prod_generation

    if batching.takes(job):  # the process's batch loop serves it: this process takes the next job at once
        batching.hand_off(job, run_prod_generation)
        return
    with batching.single_stream():
        run_prod_generation(job)


@shared_task(name="speculation.tasks.shadow_measure_task", acks_late=True, ignore_result=True)
def shadow_measure_task(**kwargs: Any) -> None:
    from speculation.worker.batching import single_stream
    from speculation.worker.shadow import measure_shadow

    with single_stream():  # it uses the loaded models' own KV caches
        measure_shadow(**kwargs)


def enqueue_prod(*, job: dict[str, Any], node_class: str, expires_s: float) -> None:
    """Queue a prod request; it expires if no worker takes it in time (the gateway has fallen back then)."""
    prod_generate_task.apply_async(args=[job], queue=gpu_queue(node_class), expires=expires_s, retry=False)


def enqueue_shadow(*, node_class: str, **kwargs: Any) -> None:
    shadow_measure_task.apply_async(kwargs=kwargs, queue=gpu_queue(node_class), retry=False)


# register the EAGLE training task with the worker (autodiscovery finds `tasks` modules only)
from speculation.worker.tasks_eagle import train_eagle_head_task  # noqa: E402, F401


@shared_task(name="speculation.tasks.refresh_rollups_task", ignore_result=True)
def refresh_rollups_task() -> int:
    """Beat runs this on the control queue every minute, so the charts' per-minute rollups stay filled even
    when no page is viewed (a page view still rolls up what is missing first)."""
    from speculation.selectors.rollup_store import refresh_rollups

    return refresh_rollups()
