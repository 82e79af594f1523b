"""Running a training run by its kind: an EAGLE head (speculation.services.eagle_training) or a draft model distilled
on captured traffic (speculation.services.draft_distillation). The Celery task calls this; each service runs its
own kind, and neither imports the other's runner."""

from __future__ import annotations

from speculation.models import TrainingKind, TrainingRun
from speculation.offline.eagle.settings import Progress
from speculation.services import draft_distillation, eagle_training


def run_training(*, run: TrainingRun, echo: Progress | None = None, register: bool = True) -> TrainingRun:
    """Run (or resume) the run in this process and register what it trained."""
    if run.kind == TrainingKind.DRAFT_MODEL:
        return draft_distillation.run_distillation(run=run, echo=echo, register=register)
    return eagle_training.run_training(run=run, echo=echo, register=register)
