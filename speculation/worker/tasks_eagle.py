"""Celery task of EAGLE head training, on the node class's GPU queue. Thin: it loads the run and calls the service.

Registered with the worker by the import in speculation/worker/tasks.py (Celery autodiscovers `tasks` modules only).
"""

from __future__ import annotations

from celery import shared_task

from ace.celery import gpu_queue


@shared_task(name="speculation.tasks_eagle.train_eagle_head_task", acks_late=True, ignore_result=True)
def train_eagle_head_task(run_id: int) -> None:
    # acks_late: a worker that dies mid-run leaves the message queued; the next worker resumes the checkpoint.
    from speculation.models import TrainingRun
    from speculation.services.eagle_training import run_training

    run_training(run=TrainingRun.objects.get(pk=run_id))


def enqueue_training(run) -> None:
    train_eagle_head_task.apply_async(args=[run.pk], queue=gpu_queue(run.node_class))
