"""How long stage records and their rollups are kept (beat runs `prune` as prune_records_task).

- Raw records older than settings.RECORD_RETENTION are deleted, and only from minutes already summed into the
  rollups (they are rolled up first), so no chart sum changes: the charts read rollups for whole minutes. They go in
  statements of PRUNE_BATCH rows, the oldest first, each its own short transaction with a pause after it: a writer
  waits for one batch at most, never for the whole prune.
- Per-minute rollups older than settings.ROLLUP_RETENTION are merged into hourly ones (rollup_store.
  merge_into_hours); the dashboard's longest range (a week) is always inside the per-minute ones.
- Captured requests past their endpoint's retention, and the oldest beyond its size cap, are deleted
  (speculation.services.captures.prune_captures).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db.models import Subquery
from django.utils import timezone

from speculation.models import StageRecord
from speculation.selectors import rollup_store
from speculation.services.captures import prune_captures

logger = logging.getLogger(__name__)

PRUNE_BATCH = 5000  # rows per DELETE: tens of milliseconds on SQLite, what a concurrent writer may wait
# between batches the pruner waits as long as the batch took (at least this): a writer retrying on SQLite's busy
# timeout sleeps up to 25 ms between tries after a batch's wait, so back-to-back batches could starve it
MIN_PAUSE_S = 0.03


@dataclass
class Pruned:
    records: int = 0
    hourly_rollups: int = 0
    captures: int = 0
    batch_seconds: list[float] = field(default_factory=list)  # how long each DELETE held the write lock


def prune(*, now: datetime | None = None, batch: int = PRUNE_BATCH) -> Pruned:
    """Delete raw records past their retention (rolled up first), merge old per-minute rollups into hours, and
    delete captures past their retention or size cap."""
    import time

    now = now or timezone.now()
    rollup_store.refresh_rollups(now=now)
    done = Pruned()
    rolled = rollup_store.rolled_until()
    if rolled is not None:
        cutoff = min(now - settings.RECORD_RETENTION, rolled)
        while True:
            oldest = StageRecord.objects.filter(created_at__lt=cutoff).order_by("created_at").values("pk")[:batch]
            started = time.perf_counter()
            deleted, _ = StageRecord.objects.filter(pk__in=Subquery(oldest)).delete()
            took = time.perf_counter() - started
            done.batch_seconds.append(took)
            done.records += deleted
            if deleted < batch:
                break
            time.sleep(max(MIN_PAUSE_S, took))  # writers waiting on the lock get in (SQLite's busy wait is not fair)
    done.hourly_rollups = rollup_store.merge_into_hours(before=now - settings.ROLLUP_RETENTION)
    done.captures = prune_captures(now=now)
    if done.records or done.hourly_rollups:
        logger.info("pruned %d stage records; %d hourly rollup rows merged", done.records, done.hourly_rollups)
    return done
