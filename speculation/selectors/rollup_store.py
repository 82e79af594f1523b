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
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db import NotSupportedError, connection, transaction
from django.db.models import Count, F, FloatField, Func, IntegerField, Q, Sum, Value
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
    lists = {
        "endpoint_id": None if endpoint_ids is None else list(endpoint_ids),
        "action": None if actions is None else list(actions),
        "mode": None if modes is None else list(modes),
        "workload": None if workloads is None else list(workloads),
    }
    result: dict[tuple, dict[str, float]] = {}

    def add(rows: Iterable[dict], names: list[str]) -> None:
        for row in rows:  # aggregated rows: one per group, never one per record
            key = tuple(row[k] for k in names)
            into = result.setdefault(key, dict.fromkeys(COLUMNS, 0))
            for c in COLUMNS:
                value = row[c]
                if value:
                    into[c] += value if not isinstance(value, Decimal) else _value(c, value)

    if a < b:
        add(_fetch(_Query("rollup", tuple(keys), bucket_s, False), a, b, lists), keys)
    # two range queries rather than one OR: each edge is a short index range scan (an OR of two ranges
    # makes SQLite scan the whole table)
    for lo, hi, closed in ((since, a, False), (b, until, True)):
        add(_fetch(_Query("raw", tuple(raw_keys), bucket_s, closed), lo, hi, lists), raw_keys)
    return result


@dataclass(frozen=True)
class _Query:
    """The shape of one of sums()'s queries: which table, grouped how, the upper bound closed or not."""

    table: str  # "rollup" or "raw"
    keys: tuple[str, ...]
    bucket_s: int | None
    closed: bool

    def build(self, lo: Any, hi: Any, lists: dict[str, list | None]) -> Any:
        filters = Q(**{f"{name}__in": values for name, values in lists.items() if values is not None})
        if self.table == "rollup":
            rows = StageRollup.objects.filter(filters, bucket_start__gte=lo, bucket_start__lt=hi)
            columns: dict[str, Any] = {c: Sum(c) for c in COLUMNS}
            time_field = "bucket_start"
        else:
            upper = "created_at__lte" if self.closed else "created_at__lt"
            rows = StageRecord.objects.filter(filters, created_at__gte=lo, **{upper: hi})
            columns, time_field = RAW_COLUMNS, "created_at"
            if "k_or_0" in self.keys:
                rows = rows.annotate(k_or_0=Coalesce("k", 0))
        if self.bucket_s:
            rows = rows.annotate(bucket=EpochBucket(time_field, seconds=self.bucket_s))
        if not self.keys:  # one row of totals (`values()` without fields would group by every column)
            return rows.annotate(everything=Value(0)).values("everything").annotate(**columns).order_by()
        return rows.values(*self.keys).annotate(**columns).order_by()


# Compiled once per shape and process: Django takes longer to build and compile the 50 aggregates of a query than
# the database takes to run it on a page's rollup rows. The shape is compiled with stand-in values, and each call
# puts its own in their places; a shape whose stand-ins cannot all be found is not cached (compiled every time).
_COMPILED: dict[tuple, tuple[str, list, list[tuple[int, str, int]]] | None] = {}
_STAND_IN_LO = datetime(1901, 1, 1, 0, 0, 1, tzinfo=UTC)
_STAND_IN_HI = datetime(1901, 1, 1, 0, 0, 2, tzinfo=UTC)


def _fetch(query: _Query, lo: datetime, hi: datetime, lists: dict[str, list | None]) -> list[dict]:
    if any(values is not None and not values for values in lists.values()):
        return []  # filtered by an empty list: no rows
    shape = (connection.vendor, query, tuple(None if v is None else len(v) for v in lists.values()))
    if shape not in _COMPILED:
        _COMPILED[shape] = _compile(query, lists)
    compiled = _COMPILED[shape]
    if compiled is None:
        return list(query.build(lo, hi, lists))
    sql, params, places = compiled
    params = list(params)
    bounds = [connection.ops.adapt_datetimefield_value(lo), connection.ops.adapt_datetimefield_value(hi)]
    for position, name, index in places:
        params[position] = bounds[index] if name == "bounds" else lists[name][index]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        names = [column[0] for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def _compile(query: _Query, lists: dict[str, list | None]) -> tuple[str, list, list[tuple[int, str, int]]] | None:
    stand_ins: dict[Any, tuple[str, int]] = {}
    fake: dict[str, list | None] = {}
    for n, (name, values) in enumerate(lists.items()):
        if values is None:
            fake[name] = None
            continue
        if name == "endpoint_id":
            fake[name] = [-(10**9) - 1000 * n - i for i in range(len(values))]
        else:
            fake[name] = [f"\x01stand-in {n}.{i}" for i in range(len(values))]
        stand_ins.update({value: (name, i) for i, value in enumerate(fake[name])})
    for index, moment in enumerate((_STAND_IN_LO, _STAND_IN_HI)):
        stand_ins[connection.ops.adapt_datetimefield_value(moment)] = ("bounds", index)
    sql, params = query.build(_STAND_IN_LO, _STAND_IN_HI, fake).query.sql_with_params()
    places = []
    for position, param in enumerate(params):
        if isinstance(param, int | str | datetime) and not isinstance(param, bool) and param in stand_ins:
            places.append((position, *stand_ins[param]))
    if sorted(place[1:] for place in places) != sorted(stand_ins.values()):
        return None
    return sql, list(params), places


def ratio(numerator: float, denominator: float, digits: int = 4) -> float | None:
    return round(numerator / denominator, digits) if denominator else None
