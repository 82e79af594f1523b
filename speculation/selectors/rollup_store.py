"""Per-minute sums of stage records (StageRollup), and reads that combine them with the newest raw records.

Why: charts over 100k+ records must not aggregate every record on every page view. Closed minutes are
summed once into StageRollup (one INSERT of GROUP BY rows, computed by the database); a read takes the
rollup rows of its range plus the raw records of the edges the rollup does not cover (the part of the
first minute before `since`... and the last minutes not rolled up yet), both as the same sums, and adds
them. Only sums and counts are stored, so the result is exactly what aggregating the raw records gives.

Records are rolled up once they are GRACE old: a record created (committed) later than that with an
older created_at would be missed; stage records are written when their request ends, well inside it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import NotSupportedError, transaction
from django.db.models import Count, F, FloatField, Func, IntegerField, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, Coalesce
from django.utils import timezone

from speculation.limits import K_MAX
from speculation.models import Action, RollupState, StageRecord, StageRollup

logger = logging.getLogger(__name__)

MAX_K = K_MAX  # per-position acceptance p1..p16, accepted-length histogram h0..h16: every K a policy may use
GRACE = timedelta(minutes=2)
ROLLUP_SECONDS = 60
HOUR_SECONDS = 3600  # the width of rollups older than settings.ROLLUP_RETENTION
STATE_NAME = "stage_records"
SPECULATIVE_ACTIONS = (Action.WOULD_SPECULATE, Action.SPECULATED)
SPEC = Q(action__in=SPECULATIVE_ACTIONS, drafted_tokens__gt=0)


class EpochBucket(Func):
    """Start (epoch seconds, UTC) of the fixed-width bucket a datetime falls in, computed by the database.

    On SQLite, Django's TruncMinute/TruncHour call back into Python for every row; this stays in SQL."""

    output_field = IntegerField()

    def __init__(self, expression: Any, *, seconds: int) -> None:
        if not isinstance(seconds, int) or seconds <= 0:
            raise ValueError("bucket width must be a positive int")
        self.seconds = seconds
        super().__init__(expression)

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list]:
        # '%%%%s' survives Func's template formatting and Django's %-param escaping as strftime's '%s'.
        template = f"((CAST(strftime('%%%%s', %(expressions)s) AS INTEGER) / {self.seconds}) * {self.seconds})"
        return self.as_sql(compiler, connection, template=template, **extra)

    def as_postgresql(self, compiler: Any, connection: Any, **extra: Any) -> tuple[str, list]:
        template = f"(FLOOR(EXTRACT(EPOCH FROM %(expressions)s) / {self.seconds}) * {self.seconds})::bigint"
        return self.as_sql(compiler, connection, template=template, **extra)

    def as_sql(self, compiler: Any, connection: Any, template: str | None = None, **extra: Any) -> tuple[str, list]:
        if template is None:
            raise NotSupportedError(f"EpochBucket is not implemented for {connection.vendor}")
        return super().as_sql(compiler, connection, template=template, **extra)


def _json_index(field: str, index: int) -> Any:
    return Cast(KT(f"{field}__{index}"), FloatField())


def _raw_columns() -> dict[str, Any]:
    """Each StageRollup column as an aggregate over raw stage records (the one definition of the sums)."""
    columns: dict[str, Any] = {
        "n": Count("id"),
        "n_spec": Count("id", filter=SPEC),
        "drafted": Sum("drafted_tokens", filter=SPEC),
        "accepted": Sum("accepted_tokens", filter=SPEC),
        "passes": Sum("target_passes", filter=SPEC),
        "k_sum": Sum("k", filter=SPEC),
        "k_n": Count("k", filter=SPEC),
        "alpha_sum": Sum("alpha", filter=SPEC),
        "alpha_n": Count("alpha", filter=SPEC),
        "mal_sum": Sum("mean_accepted_len", filter=SPEC),
        "mal_n": Count("mean_accepted_len", filter=SPEC),
        "mult_sum": Sum("multiplier"),
        "mult_n": Count("multiplier"),
        "tok_s_sum": Sum("tok_s"),
        "tok_s_n": Count("tok_s"),
        "base_sum": Sum("baseline_tok_s"),
        "base_n": Count("baseline_tok_s"),
    }
    for i in range(MAX_K):  # records hold per-position rates; weight each by the record's verification steps
        columns[f"p{i + 1}"] = Sum(_json_index("per_position_acceptance", i) * F("target_passes"), filter=SPEC)
    for i in range(MAX_K + 1):
        columns[f"h{i}"] = Sum(_json_index("accepted_length_hist", i), filter=SPEC)
    return columns


RAW_COLUMNS = _raw_columns()
COLUMNS = tuple(RAW_COLUMNS)
_FLOAT_COLUMNS = {c for c in COLUMNS if c.endswith("_sum") and c != "k_sum"} | {f"p{i + 1}" for i in range(MAX_K)}


def _floor(moment: datetime, seconds: int = ROLLUP_SECONDS) -> datetime:
    epoch = int(moment.timestamp())
    return datetime.fromtimestamp(epoch - epoch % seconds, tz=UTC)


def _ceil(moment: datetime, seconds: int = ROLLUP_SECONDS) -> datetime:
    floor = _floor(moment, seconds)
    return floor if floor == moment else floor + timedelta(seconds=seconds)


# --- filling ------------------------------------------------------------------------------------------


def refresh_rollups(*, now: datetime | None = None) -> int:
    """Sum every closed minute older than GRACE that is not rolled up yet; returns rows written.

    Serialised through the state row (SELECT ... FOR UPDATE; SQLite's IMMEDIATE transactions serialise
    writers anyway), so concurrent page views never roll up a minute twice."""
    cutoff = _floor((now or timezone.now()) - GRACE)
    done = RollupState.objects.filter(name=STATE_NAME).values_list("rolled_until", flat=True).first()
    if done is not None and done >= cutoff:
        return 0  # the common case, read-only: no write lock taken (SQLite transactions here are IMMEDIATE)
    with transaction.atomic():
        state, _ = RollupState.objects.get_or_create(name=STATE_NAME)
        state = RollupState.objects.select_for_update().get(pk=state.pk)
        start = state.rolled_until
        if start is None:
            first = StageRecord.objects.order_by("created_at").values_list("created_at", flat=True).first()
            start = _floor(first) if first is not None else cutoff
        if start >= cutoff:
            return 0
        rows = (
            StageRecord.objects.filter(created_at__gte=start, created_at__lt=cutoff)
            .annotate(bucket=EpochBucket("created_at", seconds=ROLLUP_SECONDS), kk=Coalesce("k", 0))
            .values("endpoint_id", "bucket", "mode", "action", "workload", "kk")
            .annotate(**RAW_COLUMNS)
            .order_by()
        )
        objects = [
            StageRollup(
                endpoint_id=row["endpoint_id"],
                bucket_start=datetime.fromtimestamp(row["bucket"], tz=UTC),
                mode=row["mode"],
                action=row["action"],
                workload=row["workload"],
                k=row["kk"],
                **{c: _value(c, row[c]) for c in COLUMNS},
            )
            for row in rows  # one per (endpoint, minute, mode, action, workload, K), not per record
        ]
        StageRollup.objects.bulk_create(objects, batch_size=500)
        state.rolled_until = cutoff
        state.save(update_fields=["rolled_until"])
    if objects:
        logger.info("rolled up stage records %s .. %s into %d rows", start, cutoff, len(objects))
    return len(objects)


def _value(column: str, value: Any) -> Any:
    if value is None:
        return 0
    return float(value) if column in _FLOAT_COLUMNS else int(round(value))


def rebuild_rollups() -> int:
    """Recompute the rollups from the oldest raw record on (after records were imported with past timestamps);
    older rollups, whose records retention has pruned, are kept."""
    first = StageRecord.objects.order_by("created_at").values_list("created_at", flat=True).first()
    with transaction.atomic():
        old = StageRollup.objects.all()
        if first is not None:
            old = old.filter(bucket_start__gte=_floor(first))
        old.delete()
        RollupState.objects.filter(name=STATE_NAME).update(rolled_until=None)
    return refresh_rollups()


def merge_into_hours(*, before: datetime, days_per_transaction: int = 1) -> int:
    """Merge the per-minute rollups older than `before` (floored to the hour) into one row per hour: the same sums,
    60 times fewer rows. A day per transaction, so writers wait for one day's merge at most; returns hourly rows
    written. A minute rolled up late into an already merged hour (a rebuild) is merged with that hour's row."""
    cutoff = _floor(before, HOUR_SECONDS)
    written = 0
    while True:
        first = (
            StageRollup.objects.filter(seconds=ROLLUP_SECONDS, bucket_start__lt=cutoff)
            .order_by("bucket_start")
            .values_list("bucket_start", flat=True)
            .first()
        )
        if first is None:
            return written
        start = _floor(first, HOUR_SECONDS)
        stop = min(start + timedelta(days=days_per_transaction), cutoff)
        with transaction.atomic():
            rows = StageRollup.objects.filter(bucket_start__gte=start, bucket_start__lt=stop)
            merged = (
                rows.annotate(hour=EpochBucket("bucket_start", seconds=HOUR_SECONDS))
                .values("endpoint_id", "hour", "mode", "action", "workload", "k")
                .annotate(**{c: Sum(c) for c in COLUMNS})
                .order_by()
            )
            hours = [
                StageRollup(
                    endpoint_id=row["endpoint_id"],
                    bucket_start=datetime.fromtimestamp(row["hour"], tz=UTC),
                    seconds=HOUR_SECONDS,
                    mode=row["mode"],
                    action=row["action"],
                    workload=row["workload"],
                    k=row["k"],
                    **{c: _value(c, row[c]) for c in COLUMNS},
                )
                for row in merged
            ]
            rows.delete()
            StageRollup.objects.bulk_create(hours, batch_size=500)
        written += len(hours)


def rolled_until() -> datetime | None:
    """Every record created before this is in the rollups (None: nothing rolled up yet)."""
    return RollupState.objects.filter(name=STATE_NAME).values_list("rolled_until", flat=True).first()


# --- reading ------------------------------------------------------------------------------------------


def sums(
    *,
    since: datetime,
    until: datetime,
    group: Iterable[str] = (),
    bucket_s: int | None = None,
    endpoint_ids: Iterable[int] | None = None,
    actions: Iterable[str] | None = None,
    modes: Iterable[str] | None = None,
    workloads: Iterable[str] | None = None,
    refresh: bool = True,
) -> dict[tuple, dict[str, float]]:
    """Sums of every column over records with since <= created_at <= until, grouped by `group` (any of
    endpoint_id, mode, action, workload, k) and, with bucket_s (a multiple of 60), by time bucket (epoch seconds,
    first in the key). Reads StageRollup where it covers the range and raw records elsewhere (records without a K
    group as K 0, as in the rollup). Beyond settings.ROLLUP_RETENTION the rollup holds hours: a bucket narrower
    than an hour there gets the whole hour at the hour's start."""
    if bucket_s is not None and bucket_s % ROLLUP_SECONDS:
        raise ValueError(f"bucket width must be a multiple of {ROLLUP_SECONDS} s")
    if refresh:
        refresh_rollups()
    rolled_until = RollupState.objects.filter(name=STATE_NAME).values_list("rolled_until", flat=True).first()
    # rollup covers whole minutes in [a, b); raw records cover [since, a) and [b, until]
    a = _ceil(since)
    b = min(rolled_until, _floor(until)) if rolled_until else a
    if b < a:
        a = b = since
    keys = (["bucket"] if bucket_s else []) + list(group)
    raw_keys = ["k_or_0" if key == "k" else key for key in keys]
    filters = Q()
    if endpoint_ids is not None:
        filters &= Q(endpoint_id__in=list(endpoint_ids))
    if actions is not None:
        filters &= Q(action__in=list(actions))
    if modes is not None:
        filters &= Q(mode__in=list(modes))
    if workloads is not None:
        filters &= Q(workload__in=list(workloads))

    result: dict[tuple, dict[str, float]] = {}

    def add(rows: Iterable[dict], names: list[str]) -> None:
        for row in rows:  # aggregated rows: one per group, never one per record
            key = tuple(row[k] for k in names)
            into = result.setdefault(key, dict.fromkeys(COLUMNS, 0))
            for c in COLUMNS:
                into[c] += row[c] or 0

    if a < b:
        rolled = StageRollup.objects.filter(filters, bucket_start__gte=a, bucket_start__lt=b)
        if bucket_s:
            rolled = rolled.annotate(bucket=EpochBucket("bucket_start", seconds=bucket_s))
        add(_grouped(rolled, keys, {c: Sum(c) for c in COLUMNS}), keys)
    # two range queries rather than one OR: each edge is a short index range scan (an OR of two ranges
    # makes SQLite scan the whole table)
    for edge in (Q(created_at__gte=since, created_at__lt=a), Q(created_at__gte=b, created_at__lte=until)):
        raw = StageRecord.objects.filter(filters, edge)
        if "k" in keys:
            raw = raw.annotate(k_or_0=Coalesce("k", 0))
        if bucket_s:
            raw = raw.annotate(bucket=EpochBucket("created_at", seconds=bucket_s))
        add(_grouped(raw, raw_keys, RAW_COLUMNS), raw_keys)
    return result


def _grouped(rows: Any, keys: list[str], columns: dict[str, Any]) -> Iterable[dict]:
    """The column sums per group of `keys`; no keys: one row of totals (`values()` without fields would group by
    every column: a row per rollup row or record)."""
    if not keys:
        return [rows.aggregate(**columns)]
    return rows.values(*keys).annotate(**columns).order_by()


def ratio(numerator: float, denominator: float, digits: int = 4) -> float | None:
    return round(numerator / denominator, digits) if denominator else None
