"""Celery task of training runs (EAGLE heads, and draft distillation: run_training goes by the run's kind), on the
node class's GPU queue. Thin: it loads the run and calls the service.

Registered with the worker by the import in speculation/worker/tasks.py (Celery autodiscovers `tasks` modules only).
"""

from __future__ import annotations

from celery import shared_task

from speculation.jobs.queue import TRAINING_TASK


@shared_task(name=TRAINING_TASK, acks_late=True, ignore_result=True)
def train_eagle_head_task(run_id: int) -> None:
    # acks_late: a worker that dies mid-run leaves the message queued; the next worker resumes the checkpoint.
    from speculation.models import TrainingRun
    from speculation.services.training_runs import run_training

    run_training(run=TrainingRun.objects.get(pk=run_id))
