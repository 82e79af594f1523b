"""Chart data for the dashboard and the timeseries API: pure reads, aggregated in the database.

Every function here issues a handful of aggregate queries (GROUP BY time bucket / mode / endpoint) and
only touches the few aggregated rows in Python, never the stage records themselves, so the cost stays
flat in the number of records on the Python side (see `manage.py bench_dashboard`).

Time buckets are fixed-width epoch buckets computed by the database (`EpochBucket`): on SQLite Django's
TruncMinute/TruncHour call back into Python once per row, which is too slow for 100k rows.
Per-position acceptance and the accepted-length histogram are JSON lists; they are summed index by index
with JSON extraction in SQL (`json ->> '$[i]'` on SQLite, `->> i` on PostgreSQL), so no extra table.

Metric names (ANCHORS section 1): `acceptance_rate` is accepted / drafted draft tokens (vLLM's "draft
acceptance rate"), `alpha` is the per-position acceptance probability, `mean_accepted_len` is tokens
per verification step with the bonus token (E[N], EAGLE's tau).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db import NotSupportedError
from django.db.models import Avg, Count, F, FloatField, Func, IntegerField, Q, Sum
from django.db.models.fields.json import KT
from django.db.models.functions import Cast, NullIf
from django.utils import timezone

from speculation.models import Action, PolicyChange, StageRecord

# Per-position acceptance and histograms are read up to this lookahead (the projection's K range too).
MAX_K = 8
SPECULATIVE_ACTIONS = (Action.WOULD_SPECULATE, Action.SPECULATED)


@dataclass(frozen=True)
class TimeRange:
    name: str
    span: timedelta
    bucket_s: int  # width of one chart point

    def since(self, now: datetime) -> datetime:
        return now - self.span


RANGES: dict[str, TimeRange] = {
    "hour": TimeRange("hour", timedelta(hours=1), 60),
    "day": TimeRange("day", timedelta(days=1), 600),
    "week": TimeRange("week", timedelta(days=7), 3600),
}
DEFAULT_RANGE = "day"


def get_range(name: str | None) -> TimeRange:
    """The named range; ValueError (with the choices) for an unknown name."""
    key = name or DEFAULT_RANGE
    if key not in RANGES:
        raise ValueError(f"unknown range {key!r}; choose one of {', '.join(RANGES)}")
    return RANGES[key]


class EpochBucket(Func):
    """Start (epoch seconds, UTC) of the fixed-width bucket a datetime falls in, computed by the database."""

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


def _ratio(numerator: Any, denominator: Any) -> Any:
    """numerator / denominator as a float in SQL; NULL when the denominator is 0 or NULL."""
    return Cast(numerator, FloatField()) / NullIf(Cast(denominator, FloatField()), 0.0)


def _iso(epoch_s: int) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).isoformat()


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(float(value), digits)


# --- time series ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One chartable metric: which records count, how to split them into series, what each series plots."""

    label: str
    unit: str
    where: Q
    split_by: str | None  # "mode", "action" or None (one series per entry of `values`)
    values: dict[str, Any]  # series suffix -> aggregate expression


_spec = Q(action__in=SPECULATIVE_ACTIONS, drafted_tokens__gt=0)
METRICS: dict[str, Metric] = {
    "acceptance_rate": Metric(
        "Draft acceptance rate (accepted / drafted tokens)",
        "ratio",
        _spec,
        "mode",
        {"": _ratio(Sum("accepted_tokens"), Sum("drafted_tokens"))},
    ),
    "alpha": Metric(
        "Per-position acceptance alpha", "ratio", _spec & Q(alpha__isnull=False), "mode", {"": Avg("alpha")}
    ),
    "mean_accepted_len": Metric(
        "Tokens per verification step (E[N], bonus included)",
        "tokens",
        _spec & Q(mean_accepted_len__isnull=False),
        "mode",
        {"": Avg("mean_accepted_len")},
    ),
    "tok_s": Metric(
        "Output tok/s (prod) vs baseline tok/s",
        "tok/s",
        Q(action=Action.SPECULATED, tok_s__isnull=False),
        None,
        {"speculative": Avg("tok_s"), "baseline": Avg("baseline_tok_s")},
    ),
    "multiplier": Metric(
        "tok/s multiplier (shadow: projected, prod: measured)",
        "x",
        Q(action__in=SPECULATIVE_ACTIONS, multiplier__isnull=False),
        "mode",
        {"": Avg("multiplier")},
    ),
    "requests": Metric("Requests seen by the stage", "requests", Q(), "action", {"": Count("id")}),
}


def timeseries(*, endpoint_id: int, metric: str, range_name: str | None = None, now: datetime | None = None) -> dict:
    """One metric over time for one endpoint: series of (bucket start, value, record count), plus the
    policy change points in the range. Raises ValueError for an unknown metric or range."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    spec = METRICS[metric]
    time_range = get_range(range_name)
    now = now or timezone.now()
    since = time_range.since(now)
    group = ["bucket"] + ([spec.split_by] if spec.split_by else [])
    aggregates = {f"v{i}": expr for i, expr in enumerate(spec.values.values())}
    rows = (
        StageRecord.objects.filter(spec.where, endpoint_id=endpoint_id, created_at__gte=since, created_at__lte=now)
        .annotate(bucket=EpochBucket(F("created_at"), seconds=time_range.bucket_s))
        .values(*group)
        .annotate(n=Count("id"), **aggregates)
        .order_by(*group)
    )
    series: dict[str, dict] = {}
    for row in rows:  # one row per (bucket, series): at most a few hundred
        for i, suffix in enumerate(spec.values):
            name = "-".join(part for part in (row.get(spec.split_by) if spec.split_by else "", suffix) if part)
            entry = series.setdefault(name, {"name": name or metric, "t": [], "y": [], "n": []})
            entry["t"].append(_iso(row["bucket"]))
            entry["y"].append(_round(row[f"v{i}"]))
            entry["n"].append(row["n"])
    return {
        "endpoint": endpoint_id,
        "metric": metric,
        "label": spec.label,
        "unit": spec.unit,
        "range": time_range.name,
        "bucket_seconds": time_range.bucket_s,
        "since": since.isoformat(),
        "until": now.isoformat(),
        "series": sorted(series.values(), key=lambda s: s["name"]),
        "change_points": policy_change_points(endpoint_id=endpoint_id, since=since, until=now),
    }


def policy_change_points(*, endpoint_id: int, since: datetime, until: datetime, limit: int = 200) -> list[dict]:
    """Policy changes in [since, until], oldest first: when, who, and a one-line summary."""
    rows = (
        PolicyChange.objects.filter(policy__endpoint_id=endpoint_id, changed_at__gte=since, changed_at__lte=until)
        .order_by("-changed_at", "-id")
        .values("changed_at", "changes", "changed_by__username")[:limit]
    )
    points = []
    for row in reversed(list(rows)):
        changes = row["changes"] if isinstance(row["changes"], dict) else {}
        summary = ", ".join(f"{field}: {_pair(value)}" for field, value in sorted(changes.items()))
        points.append(
            {
                "at": row["changed_at"].isoformat(),
                "by": row["changed_by__username"] or "",
                "changes": changes,
                "summary": summary,
            }
        )
    return points


def _pair(value: Any) -> str:
    if isinstance(value, list | tuple) and len(value) == 2:
        return f"{value[0]} -> {value[1]}"
    return str(value)


# --- distributions ------------------------------------------------------------------------------------


def _json_index(field: str, index: int) -> Any:
    return Cast(KT(f"{field}__{index}"), FloatField())


def per_position_acceptance(*, endpoint_id: int, since: datetime, until: datetime | None = None) -> dict[str, list]:
    """Per mode: acceptance at draft positions 1..MAX_K, i.e. the sum over records of accepted draft tokens
    at position i divided by the sum of verification steps that drafted position i (records' per-position
    lists hold counts). Positions no record drafted are None."""
    until = until or timezone.now()
    aggregates = {f"a{i}": Sum(_json_index("per_position_acceptance", i)) for i in range(MAX_K)}
    rows = (
        StageRecord.objects.filter(_spec, endpoint_id=endpoint_id, created_at__gte=since, created_at__lte=until)
        .values("mode")
        .annotate(steps=Sum("target_passes"), **aggregates)
        .order_by("mode")
    )
    result: dict[str, list] = {}
    for row in rows:
        steps = row["steps"] or 0
        result[row["mode"]] = [
            None if row[f"a{i}"] is None or not steps else _round(row[f"a{i}"] / steps) for i in range(MAX_K)
        ]
    return result


def accepted_length_histogram(*, endpoint_id: int, since: datetime, until: datetime | None = None) -> dict[str, list]:
    """Per mode: how many verification steps accepted 0, 1, ..., MAX_K draft tokens (summed lists)."""
    until = until or timezone.now()
    aggregates = {f"h{i}": Sum(_json_index("accepted_length_hist", i)) for i in range(MAX_K + 1)}
    rows = (
        StageRecord.objects.filter(_spec, endpoint_id=endpoint_id, created_at__gte=since, created_at__lte=until)
        .values("mode")
        .annotate(**aggregates)
        .order_by("mode")
    )
    result: dict[str, list] = {}
    for row in rows:
        counts = [int(row[f"h{i}"] or 0) for i in range(MAX_K + 1)]
        while counts and counts[-1] == 0:
            counts.pop()
        result[row["mode"]] = counts
    return result


# --- summaries ----------------------------------------------------------------------------------------

SUMMARY_WINDOWS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}


def _window_aggregates(prefix: str, window: Q) -> dict[str, Any]:
    spec = window & _spec
    prod = window & Q(action=Action.SPECULATED)
    shadow = window & Q(action=Action.WOULD_SPECULATE)
    return {
        f"{prefix}requests": Count("id", filter=window),
        f"{prefix}speculated": Count("id", filter=prod),
        f"{prefix}shadowed": Count("id", filter=shadow),
        f"{prefix}skipped": Count("id", filter=window & Q(action=Action.SKIPPED)),
        f"{prefix}fell_back": Count("id", filter=window & Q(action=Action.FELL_BACK)),
        f"{prefix}acceptance_rate": _ratio(Sum("accepted_tokens", filter=spec), Sum("drafted_tokens", filter=spec)),
        f"{prefix}alpha": Avg("alpha", filter=spec),
        f"{prefix}multiplier": Avg("multiplier", filter=prod),
        f"{prefix}projected_multiplier": Avg("multiplier", filter=shadow),
        f"{prefix}tok_s": Avg("tok_s", filter=prod),
        f"{prefix}baseline_tok_s": Avg("baseline_tok_s", filter=prod),
    }


def fleet_summary(*, endpoint_ids: list[int] | None = None, now: datetime | None = None) -> dict[int, dict]:
    """For each endpoint with records in the last day: {"hour": {...}, "day": {...}} with request counts
    per action, acceptance rate, alpha, measured (prod) and projected (shadow) multiplier, tok/s and
    baseline tok/s. One grouped query for the whole fleet."""
    now = now or timezone.now()
    aggregates: dict[str, Any] = {}
    for name, span in SUMMARY_WINDOWS.items():
        aggregates |= _window_aggregates(f"{name}__", Q(created_at__gte=now - span))
    qs = StageRecord.objects.filter(created_at__gte=now - max(SUMMARY_WINDOWS.values()), created_at__lte=now)
    if endpoint_ids is not None:
        qs = qs.filter(endpoint_id__in=endpoint_ids)
    summary: dict[int, dict] = {}
    for row in qs.values("endpoint_id").annotate(**aggregates).order_by("endpoint_id"):
        per_window: dict[str, dict] = {name: {} for name in SUMMARY_WINDOWS}
        for key, value in row.items():
            if "__" in key:
                window, field = key.split("__", 1)
                per_window[window][field] = _round(value) if isinstance(value, float) else value
        summary[row["endpoint_id"]] = per_window
    return summary


def measured_acceptance(*, endpoint_id: int, since: datetime, until: datetime | None = None) -> dict:
    """What shadow measured over a window: records, drafted/accepted tokens, acceptance rate, mean alpha,
    mean E[N], mean projected multiplier and the K the measurements used."""
    until = until or timezone.now()
    row = StageRecord.objects.filter(
        _spec, action=Action.WOULD_SPECULATE, endpoint_id=endpoint_id, created_at__gte=since, created_at__lte=until
    ).aggregate(
        records=Count("id"),
        drafted=Sum("drafted_tokens"),
        accepted=Sum("accepted_tokens"),
        acceptance_rate=_ratio(Sum("accepted_tokens"), Sum("drafted_tokens")),
        alpha=Avg("alpha"),
        mean_accepted_len=Avg("mean_accepted_len"),
        projected_multiplier=Avg("multiplier"),
        k=Avg("k"),
    )
    return {key: _round(value) if isinstance(value, float) else value for key, value in row.items()}


# --- records table ------------------------------------------------------------------------------------

RECORD_COLUMNS = (
    "id",
    "created_at",
    "request_id",
    "mode",
    "action",
    "reason",
    "path",
    "k",
    "drafted_tokens",
    "accepted_tokens",
    "acceptance_rate",
    "output_tokens",
    "tok_s",
    "baseline_tok_s",
    "multiplier",
    "latency_ms",
)


def stage_records(
    *,
    endpoint_id: int,
    action: str | None = None,
    mode: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
):
    """Newest first, filtered, only the columns the table shows (paginate the result; it is lazy)."""
    qs = StageRecord.objects.filter(endpoint_id=endpoint_id)
    if action:
        qs = qs.filter(action=action)
    if mode:
        qs = qs.filter(mode=mode)
    if since:
        qs = qs.filter(created_at__gte=since)
    if until:
        qs = qs.filter(created_at__lte=until)
    return qs.only(*RECORD_COLUMNS).order_by("-created_at", "-id")


# --- costs for the projection ---------------------------------------------------------------------------


def measured_costs(*, endpoint: Any) -> dict:
    """The cost ratios the projection needs, from measurements only, each with where it came from.

    target step: the probe's time per output token (`tpot_ms`); draft step: the draft's measured step time
    (`step_ms` in its config, written by calibration) -- an n-gram lookup costs no model step (c = 0);
    v (verify K+1 tokens / one target step) is only known once measured (`verify_ratio` in the probe's
    capabilities). Missing ones are None with the reason in `missing`.
    """
    caps = endpoint.capabilities or {}
    target_ms = caps.get("tpot_ms")
    policy = getattr(endpoint, "policy", None)
    draft = policy.draft if policy is not None and policy.draft_id else None
    mechanism = policy.mechanism if policy is not None else ""
    missing: list[str] = []
    c = None
    draft_ms = None
    if mechanism == "ngram":
        c = 0.0
        draft_ms = 0.0
    elif draft is not None and (draft.config or {}).get("step_ms"):
        draft_ms = float(draft.config["step_ms"])
        if target_ms:
            c = draft_ms / float(target_ms)
    if c is None:
        if not target_ms:
            missing.append("the target's time per output token (probe the endpoint)")
        if draft_ms is None:
            missing.append("the draft's step time (calibrate the draft)")
    v = caps.get("verify_ratio")
    if v is None:
        missing.append("the verification cost v (not measured; v = 1 is the GPU memory-bound value)")
    return {
        "target_step_ms": target_ms,
        "draft_step_ms": draft_ms,
        "c": None if c is None else round(c, 4),
        "v": v,
        "missing": missing,
    }
