"""The fleet app's queue side: Celery tasks (thin, over fleet.probing) and the functions that enqueue them.

fleet.probing runs a probe; this module decides when one runs (a new or changed endpoint, the periodic re-probe),
so the dependency goes one way: tasks -> probing.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet import probing
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus

logger = logging.getLogger(__name__)

ENQUEUE_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}


@shared_task(name="fleet.tasks.probe_endpoint_task", acks_late=True, ignore_result=True)
def probe_endpoint_task(probe_id: int) -> str:
    probe = probing.run_probe(probe_id)
    return probe.outcome if probe is not None else "gone"


@shared_task(name="fleet.tasks.reprobe_all_task", ignore_result=True)
def reprobe_all_task() -> int:
    return reprobe_all()


def start_probe(endpoint: Endpoint) -> Probe:
    """Create a queued Probe and enqueue the probe task once the surrounding transaction commits."""
    probe = Probe.objects.create(endpoint=endpoint, status=ProbeStatus.QUEUED)
    if endpoint.status == EndpointStatus.NEW:
        Endpoint.objects.filter(pk=endpoint.pk, status=EndpointStatus.NEW).update(status=EndpointStatus.PROBING)
        endpoint.status = EndpointStatus.PROBING
    transaction.on_commit(lambda: _enqueue(probe.pk))
    return probe


def _enqueue(probe_id: int) -> None:
    try:
        probe_endpoint_task.apply_async(
            args=[probe_id], queue=settings.CONTROL_QUEUE, retry=True, retry_policy=ENQUEUE_RETRY_POLICY
        )
    except Exception as exc:  # the broker is down: the probe is a result too, not a 500
        logger.warning("could not queue probe %s: %s", probe_id, exc)
        now = timezone.now()
        Probe.objects.filter(pk=probe_id, status=ProbeStatus.QUEUED).update(
            status=ProbeStatus.DONE,
            outcome=EndpointStatus.ERROR,
            reason=f"could not queue the probe: the task broker is unreachable ({type(exc).__name__})",
            errors=[{"step": "queue", "kind": "broker_unreachable", "message": str(exc)[:300]}],
            finished_at=now,
        )


def reprobe_all() -> int:
    """Queue a probe of every endpoint that has none pending; returns how many were queued.

    A probe still queued or running after two intervals was lost (worker or broker gone): it is closed as an
    error so that it does not stay pending forever, and the endpoint is probed again.
    """
    stale_before = timezone.now() - timedelta(seconds=2 * settings.PROBE_INTERVAL_S)
    pending = [ProbeStatus.QUEUED, ProbeStatus.RUNNING]
    Probe.objects.filter(status__in=pending, created_at__lt=stale_before).update(
        status=ProbeStatus.DONE,
        outcome=EndpointStatus.ERROR,
        reason="lost: the probe was never finished (worker or broker gone?)",
        finished_at=timezone.now(),
    )
    queued = 0
    for endpoint in Endpoint.objects.exclude(probes__status__in=pending):
        with transaction.atomic():
            start_probe(endpoint)
        queued += 1
    return queued
