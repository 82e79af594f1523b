"""Retraining on captured traffic, on a schedule: traffic drifts, and a head trained on last month's requests
drafts worse for this month's.

A run on an endpoint's captured traffic that finished is repeated (same target, sources, settings, owner and
team) once at least RETRAIN_MIN_NEW requests were captured after it finished: beat's retrain_from_captures_task
checks hourly. The repeat goes through create_training_run like any run, so its owner must still be an admin of the
endpoint's team (else it is not repeated, logged), and its head is proved on its held-out captures and may be
switched in by `draft: auto` as the first one was (speculation.services.capture_replay). The repeat continues from the
head the endpoint drafts with now when it fits the run (a warm start, speculation.offline.eagle.warm_start), so the
head serving the endpoint adapts to the new traffic instead of being replaced by one trained on the captures alone;
otherwise it starts from scratch, logged.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime

from django.core.exceptions import ValidationError
from django.utils import timezone

from fleet.models import Endpoint
from speculation.models import CapturedRequest, TrainingKind, TrainingRun, TrainingStatus
from speculation.offline.eagle.prompts import CAPTURED, captured_source
from speculation.offline.eagle.settings import PipelineSettings, TrainSettings
from speculation.offline.eagle.warm_start import WARM_START_LR
from speculation.services.eagle_training import current_head

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
    runs = TrainingRun.objects.filter(prompts__startswith=f"{CAPTURED}:", kind=TrainingKind.EAGLE_HEAD)  # heads only
    for run in runs.order_by("created_at", "pk"):
        latest[run.prompts] = run
    return [
        run
        for run in latest.values()
        if run.status == TrainingStatus.DONE and run.finished_at is not None and _new_captures(run) >= min_new
    ]


def _options(run: TrainingRun) -> dict:
    """The run's settings as create_training_run's options: everything but prompts, epochs, seed, the head it started
    from and a default learning rate (a new head's or a warm start's: the repeat gets the one for how it starts)."""
    settings = PipelineSettings.from_dict(run.config).as_dict()
    train = settings.pop("train")
    settings.pop("prompts")
    default_lr = WARM_START_LR if settings.pop("init_from") else TrainSettings.lr
    dropped = ("epochs", "seed", "lr") if train["lr"] == default_lr else ("epochs", "seed")
    return {**settings, **{k: v for k, v in train.items() if k not in dropped}}


def _current_head(run: TrainingRun) -> str:
    """The name of the EAGLE head the run's (first) endpoint drafts with now, or ""."""
    endpoint, _ = captured_source(run.prompts.split(",")[0]) or ("", None)
    found = Endpoint.objects.select_related("policy__draft").filter(pk=int(endpoint or 0)).first()
    head = current_head(found) if found is not None else None
    return head.name if head is not None else ""


def retrain(run: TrainingRun, *, now: datetime | None = None) -> TrainingRun | None:
    """Queue the run again on the traffic captured until now (a new out directory beside the old one); None when
    it may not be repeated (its owner is no longer the endpoint team's admin, or the target moved), logged."""
    from speculation.services.eagle_training import start_training_run

    stamp = (now or timezone.now()).strftime("%Y%m%d%H%M")
    out_dir, name = (_STAMPED.sub("", value) for value in (run.out_dir.rstrip("/"), run.name))  # a repeat's repeat
    fields = {
        "target_dir": run.target_dir, "out_dir": f"{out_dir}-{stamp}", "name": f"{name[:51]}-{stamp}",
        "target_name": run.target_name, "prompts": run.prompts, "epochs": run.epochs, "seed": run.seed,
        "node_class": run.node_class, "options": _options(run), "owner": run.owner, "team": run.team,
    }  # fmt: skip
    try:
        head = _current_head(run)
        if head:
            try:
                return start_training_run(**fields, init_from=head)
            except ValidationError as exc:
                if "init_from" not in getattr(exc, "error_dict", {}):
                    raise
                logger.info("training run %s repeated from scratch: %s", run.pk, "; ".join(exc.messages))
        return start_training_run(**fields)
    except ValidationError as exc:
        logger.warning("training run %s not repeated on new captures: %s", run.pk, "; ".join(exc.messages))
        return None


def retrain_due(*, now: datetime | None = None) -> list[TrainingRun]:
    """Repeat every run that is due (beat's retrain_from_captures_task); returns the runs queued."""
    queued = [new for run in due() if (new := retrain(run, now=now)) is not None]
    if queued:
        logger.info("queued %d training runs on new captured traffic", len(queued))
    return queued
