"""Celery tasks of the fleet app: thin interfaces over fleet.probing."""

from __future__ import annotations

from celery import shared_task

from fleet import probing


@shared_task(name="fleet.tasks.probe_endpoint_task", acks_late=True, ignore_result=True)
def probe_endpoint_task(probe_id: int) -> str:
    probe = probing.run_probe(probe_id)
    return probe.outcome if probe is not None else "gone"


@shared_task(name="fleet.tasks.reprobe_all_task", ignore_result=True)
def reprobe_all_task() -> int:
    return probing.reprobe_all()
