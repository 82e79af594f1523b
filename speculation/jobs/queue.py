"""Queueing jobs for a node class's GPU workers, by task name.

A task is sent by its registered name (Celery's send_task), so the web process never imports the worker package
and the worker's modules never import its task module (speculation.worker.tasks registers the names below and
reads prod and shadow jobs back with speculation.jobs.job). Prod and shadow jobs go on the node class's GPU queue,
calibrations and candidate replays on its background queue (ace.celery).
"""

from __future__ import annotations

from typing import Any

from ace.celery import app, background_queue, gpu_queue
from speculation.jobs.job import ProdJob, ShadowJob

PROD_TASK = "speculation.tasks.prod_generate_task"
SHADOW_TASK = "speculation.tasks.shadow_measure_task"
CALIBRATION_TASK = "speculation.tasks.calibrate_costs_task"
CANDIDATES_TASK = "speculation.tasks.replay_candidates_task"
TRAINING_TASK = "speculation.tasks_eagle.train_eagle_head_task"


def enqueue_prod(job: ProdJob, *, expires_s: float) -> None:
    """Queue a prod request; it expires if no worker takes it in time (the gateway has fallen back then)."""
    app.send_task(PROD_TASK, args=[job.to_dict()], queue=gpu_queue(job.node_class), expires=expires_s, retry=False)


def enqueue_shadow(job: ShadowJob, *, node_class: str) -> None:
    """Queue a served request for its shadow measurement."""
    app.send_task(SHADOW_TASK, kwargs=job.to_dict(), queue=gpu_queue(node_class), retry=False)


def enqueue_calibration(*, node_class: str, **kwargs: Any) -> None:
    """Queue one cost calibration (speculation.worker.costs.calibrate's keyword arguments)."""
    app.send_task(
        CALIBRATION_TASK, kwargs={**kwargs, "node_class": node_class}, queue=background_queue(node_class), retry=False
    )


def enqueue_candidates(*, node_class: str, **kwargs: Any) -> None:
    """Queue the candidate replays of one shadowed request (speculation.worker.candidates)."""
    app.send_task(
        CANDIDATES_TASK, kwargs={**kwargs, "node_class": node_class}, queue=background_queue(node_class), retry=False
    )


def enqueue_training(*, run_id: int, node_class: str) -> None:
    """Queue a training run (an EAGLE head, a draft distillation) on the node class's GPU queue."""
    app.send_task(TRAINING_TASK, args=[run_id], queue=gpu_queue(node_class))


def enqueue_training_on_commit(run: Any) -> None:
    """Queue the training run once the transaction that saved its row commits (the task reads the row)."""
    from django.db import transaction

    transaction.on_commit(lambda: enqueue_training(run_id=run.pk, node_class=run.node_class))
