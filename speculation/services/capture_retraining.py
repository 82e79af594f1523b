"""Retraining on captured traffic, on a schedule: traffic drifts, and a head trained on last month's requests
drafts worse for this month's.

A run on an endpoint's captured traffic that finished is repeated (same target, sources, settings, owner and
team) once at least RETRAIN_MIN_NEW requests were captured after it finished: beat's retrain_from_captures_task
checks hourly. The repeat goes through create_training_run like any run, so its owner must still be an admin of the
endpoint's team (else it is not repeated, logged), and its head is proved on its held-out captures and may be
switched in by `draft: auto` as the first one was (speculation.services.capture_replay).
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

from django.core.exceptions import ValidationError
from django.utils import timezone

from speculation.models import CapturedRequest, TrainingRun, TrainingStatus
from speculation.offline.eagle.prompts import CAPTURED, captured_source
from speculation.offline.eagle.settings import PipelineSettings

logger = logging.getLogger(__name__)

RETRAIN_MIN_NEW = 200  # captures since the last run finished before it is repeated
_STAMPED = re.compile(r"-\d{12}$")  # the suffix a repeat adds to the out directory and the name


def _new_captures(run: TrainingRun) -> int:
    count = 0
    for part in run.prompts.split(","):
        endpoint, workload = captured_source(part) or ("", None)
        rows = CapturedRequest.objects.filter(endpoint_id=int(endpoint), created_at__gt=run.finished_at)
        count += (rows.filter(workload=workload) if workload else rows).count()
    return count


def due(*, min_new: int = RETRAIN_MIN_NEW) -> list[TrainingRun]:
    """The latest finished run of each captured source whose endpoints captured at least min_new requests since,
    and that is not being repeated already (a newer run of the same sources queued or running)."""
    latest: dict[str, TrainingRun] = {}
    for run in TrainingRun.objects.filter(prompts__startswith=f"{CAPTURED}:").order_by("created_at", "pk"):
        latest[run.prompts] = run
    return [
        run
        for run in latest.values()
        if run.status == TrainingStatus.DONE and run.finished_at is not None and _new_captures(run) >= min_new
    ]


def _options(run: TrainingRun) -> dict:
    """The run's settings as create_training_run's options (everything but prompts, epochs and seed)."""
    settings = PipelineSettings.from_dict(run.config).as_dict()
    train = settings.pop("train")
    settings.pop("prompts")
    return {**settings, **{k: v for k, v in train.items() if k not in ("epochs", "seed")}}


def retrain(run: TrainingRun, *, now: datetime | None = None) -> TrainingRun | None:
    """Queue the run again on the traffic captured until now (a new out directory beside the old one); None when
    it may not be repeated (its owner is no longer the endpoint team's admin, or the target moved), logged."""
    from speculation.services.eagle_training import start_training_run

    stamp = (now or timezone.now()).strftime("%Y%m%d%H%M")
    out_dir, name = (_STAMPED.sub("", value) for value in (run.out_dir.rstrip("/"), run.name))  # a repeat's repeat
    try:
        return start_training_run(
            target_dir=run.target_dir,
            out_dir=f"{out_dir}-{stamp}",
            name=f"{name[:51]}-{stamp}",
            target_name=run.target_name,
            prompts=run.prompts,
            epochs=run.epochs,
            seed=run.seed,
            node_class=run.node_class,
            options=_options(run),
            owner=run.owner,
            team=run.team,
        )
    except ValidationError as exc:
        logger.warning("training run %s not repeated on new captures: %s", run.pk, "; ".join(exc.messages))
        return None


def retrain_due(*, now: datetime | None = None) -> list[TrainingRun]:
    """Repeat every run that is due (beat's retrain_from_captures_task); returns the runs queued."""
    queued = [new for run in due() if (new := retrain(run, now=now)) is not None]
    if queued:
        logger.info("queued %d training runs on new captured traffic", len(queued))
    return queued
