"""Chart data for the dashboard and the timeseries API, aggregated in the database.

Reading is not write-free: `rollup_store.sums` first rolls up closed minutes that beat's `refresh_rollups_task`
has not summed yet (normally none; a few rows after a quiet minute), then reads.

Everything is computed from sums: speculation.selectors.rollup_store adds per-minute StageRollup rows (summed once by
the database) to aggregates of the newest raw records, so a page over 100k records reads a few thousand
pre-summed rows at most and never loops over records in Python (see `manage.py bench_dashboard`).

Metric names (ANCHORS section 1): `acceptance_rate` is accepted / drafted draft tokens (vLLM's "draft
acceptance rate"), `alpha` is the per-position acceptance probability, `mean_accepted_len` is tokens
per verification step with the bonus token (E[N], EAGLE's tau). Per-position acceptance: each record
holds the rate at which draft position i was accepted; records are pooled weighted by their verification
steps (target_passes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.utils import timezone

from speculation.models import Action, PolicyChange, StageRecord
from speculation.selectors.rollup_store import COLUMNS, MAX_K, SPECULATIVE_ACTIONS, ratio, sums

Totals = dict[tuple, dict[str, float]]

__all__ = ["MAX_K", "SPECULATIVE_ACTIONS"]


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


def _iso(epoch_s: int) -> str:
    return datetime.fromtimestamp(epoch_s, tz=UTC).isoformat()


# --- time series ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One chartable metric: which records count, how they split into series, and each series' value as
    numerator / denominator column sums (denominator None: the numerator itself)."""

    label: str
    unit: str
    actions: tuple[str, ...] | None
    split_by: str | None  # "mode", "action" or None (one series per entry of `values`)
    values: dict[str, tuple[str, str | None]]
    count: str  # the column that says how many records a point stands for


METRICS: dict[str, Metric] = {
    "acceptance_rate": Metric(
        "Draft acceptance rate (accepted / drafted tokens)",
        "ratio",
        SPECULATIVE_ACTIONS,
        "mode",
        {"": ("accepted", "drafted")},
        "n_spec",
    ),
    "alpha": Metric(
        "Per-position acceptance alpha", "ratio", SPECULATIVE_ACTIONS, "mode", {"": ("alpha_sum", "alpha_n")}, "alpha_n"
    ),
    "mean_accepted_len": Metric(
        "Tokens per verification step (E[N], bonus included)",
        "tokens",
        SPECULATIVE_ACTIONS,
        "mode",
        {"": ("mal_sum", "mal_n")},
        "mal_n",
    ),
    "tok_s": Metric(
        "Output tok/s (prod) vs baseline tok/s",
        "tok/s",
        (Action.SPECULATED,),
        None,
        {"speculative": ("tok_s_sum", "tok_s_n"), "baseline": ("base_sum", "base_n")},
        "tok_s_n",
    ),
    "multiplier": Metric(
        "tok/s multiplier (shadow: projected, prod: measured)",
        "x",
        SPECULATIVE_ACTIONS,
        "mode",
        {"": ("mult_sum", "mult_n")},
        "mult_n",
    ),
    "requests": Metric("Requests seen by the stage", "requests", None, "action", {"": ("n", None)}, "n"),
}


def _collapse(totals: Totals, *, actions: tuple[str, ...] | None, key: Callable[[tuple], tuple]) -> Totals:
    """Re-group (bucket, mode, action) sums by key(bucket, mode, action), keeping only `actions`."""
    out: Totals = {}
    for (bucket, mode, action), row in totals.items():  # aggregated rows (a few per bucket), not records
        if actions is not None and action not in actions:
            continue
        into = out.setdefault(key((bucket, mode, action)), dict.fromkeys(COLUMNS, 0))
        for column in COLUMNS:
            into[column] += row[column]
    return out


def _bucketed(*, endpoint_id: int, time_range: TimeRange, now: datetime, workload: str | None = None) -> Totals:
    """Everything an endpoint's charts need in one read: sums per (bucket, mode, action), of one workload or all."""
    return sums(
        since=time_range.since(now),
        until=now,
        group=["mode", "action"],
        bucket_s=time_range.bucket_s,
        endpoint_ids=[endpoint_id],
        workloads=None if workload is None else [workload],
    )


def _series(spec: Metric, metric: str, totals: Totals) -> list[dict]:
    split = {"mode": 1, "action": 2}.get(spec.split_by or "")
    points = _collapse(totals, actions=spec.actions, key=lambda k: (k[0], k[split]) if split is not None else (k[0],))
    series: dict[str, dict] = {}
    for key in sorted(points):  # (bucket[, split]) -> sums: one per chart point
        row = points[key]
        if not row[spec.count]:
            continue
        for suffix, (numerator, denominator) in spec.values.items():
            name = "-".join(part for part in (key[1] if split is not None else "", suffix) if part)
            value = row[numerator] if denominator is None else ratio(row[numerator], row[denominator])
            entry = series.setdefault(name, {"name": name or metric, "t": [], "y": [], "n": []})
            entry["t"].append(_iso(key[0]))
            entry["y"].append(None if value is None else round(float(value), 4))
            entry["n"].append(int(row[spec.count]))
    return sorted(series.values(), key=lambda s: s["name"])


def _timeseries_payload(
    *, endpoint_id: int, metric: str, time_range: TimeRange, now: datetime, totals: Totals, change_points: list[dict]
) -> dict:
    spec = METRICS[metric]
    return {
        "endpoint": endpoint_id,
        "metric": metric,
        "label": spec.label,
        "unit": spec.unit,
        "range": time_range.name,
        "bucket_seconds": time_range.bucket_s,
        "since": time_range.since(now).isoformat(),
        "until": now.isoformat(),
        "series": _series(spec, metric, totals),
        "change_points": change_points,
    }


def timeseries(
    *,
    endpoint_id: int,
    metric: str,
    range_name: str | None = None,
    now: datetime | None = None,
    workload: str | None = None,
) -> dict:
    """One metric over time for one endpoint (one workload's requests, or all): series of (bucket start, value,
    record count), plus the policy change points in the range. Raises ValueError for an unknown metric or range."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
    time_range = get_range(range_name)
    now = now or timezone.now()
    totals = _bucketed(endpoint_id=endpoint_id, time_range=time_range, now=now, workload=workload)
    changes = policy_change_points(endpoint_id=endpoint_id, since=time_range.since(now), until=now)
    return _timeseries_payload(
        endpoint_id=endpoint_id, metric=metric, time_range=time_range, now=now, totals=totals, change_points=changes
    )


def endpoint_charts(
    *,
    endpoint_id: int,
    metrics: tuple[str, ...],
    range_name: str | None = None,
    now: datetime | None = None,
    workload: str | None = None,
) -> dict:
    """The endpoint page's charts from one read (one workload's requests, or all): the named time series,
    per-position acceptance and the accepted-length histogram over the range."""
    time_range = get_range(range_name)
    now = now or timezone.now()
    totals = _bucketed(endpoint_id=endpoint_id, time_range=time_range, now=now, workload=workload)
    return _charts(endpoint_id=endpoint_id, metrics=metrics, time_range=time_range, now=now, totals=totals)


def endpoint_page_data(
    *,
    endpoint_id: int,
    metrics: tuple[str, ...],
    range_name: str | None = None,
    now: datetime | None = None,
    workload: str | None = None,
) -> tuple[dict, Totals]:
    """The endpoint page's charts (as endpoint_charts) and the figures beside them (endpoint_totals' rows over the
    same range). Showing every workload, one read: sums per bucket, mode, action, workload and K, summed both ways;
    showing one workload's charts, two."""
    time_range = get_range(range_name)
    now = now or timezone.now()
    since = time_range.since(now)
    if workload is not None:
        charts = endpoint_charts(
            endpoint_id=endpoint_id, metrics=metrics, range_name=range_name, now=now, workload=workload
        )
        return charts, endpoint_totals(endpoint_id=endpoint_id, since=since, until=now)
    rows = sums(since=since, until=now, group=ENDPOINT_GROUPS, bucket_s=time_range.bucket_s, endpoint_ids=[endpoint_id])
    bucketed: Totals = {}
    totals: Totals = {}
    for key, row in rows.items():  # aggregated rows: a few per bucket
        for into in (
            bucketed.setdefault(key[:3], dict.fromkeys(COLUMNS, 0)),
            totals.setdefault(key[1:], dict.fromkeys(COLUMNS, 0)),
        ):
            for column in COLUMNS:
                into[column] += row[column]
    return _charts(endpoint_id=endpoint_id, metrics=metrics, time_range=time_range, now=now, totals=bucketed), totals


def _charts(
    *, endpoint_id: int, metrics: tuple[str, ...], time_range: TimeRange, now: datetime, totals: Totals
) -> dict:
    changes = policy_change_points(endpoint_id=endpoint_id, since=time_range.since(now), until=now)
    charts: dict[str, Any] = {
        m: _timeseries_payload(
            endpoint_id=endpoint_id, metric=m, time_range=time_range, now=now, totals=totals, change_points=changes
        )
        for m in metrics
    }
    per_mode = _collapse(totals, actions=SPECULATIVE_ACTIONS, key=lambda k: (k[1],))
    charts["per_position"] = _per_position(per_mode)
    charts["histogram"] = _histogram(per_mode)
    return charts


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


def _per_mode(*, endpoint_id: int, since: datetime, until: datetime | None, workload: str | None = None) -> Totals:
    totals = sums(
        since=since,
        until=until or timezone.now(),
        group=["mode", "action"],
        endpoint_ids=[endpoint_id],
        workloads=None if workload is None else [workload],
    )
    return _collapse({(0, *k): v for k, v in totals.items()}, actions=SPECULATIVE_ACTIONS, key=lambda k: (k[1],))


def _per_position(per_mode: Totals) -> dict[str, list]:
    result: dict[str, list] = {}
    for (mode,), row in sorted(per_mode.items()):
        if not row["n_spec"]:
            continue
        # positions drafted: up to the mean K, or further where a position was accepted
        reached = [i for i in range(1, MAX_K + 1) if row[f"p{i}"]]
        depth = max(math.ceil(row["k_sum"] / row["k_n"]) if row["k_n"] else 1, max(reached, default=0))
        result[mode] = [ratio(row[f"p{i}"], row["passes"]) if i <= depth else None for i in range(1, MAX_K + 1)]
    return result


def _histogram(per_mode: Totals) -> dict[str, list]:
    result: dict[str, list] = {}
    for (mode,), row in sorted(per_mode.items()):
        if not row["n_spec"]:
            continue
        counts = [int(row[f"h{i}"]) for i in range(MAX_K + 1)]
        while counts and counts[-1] == 0:
            counts.pop()
        result[mode] = counts
    return result


def per_position_acceptance(
    *, endpoint_id: int, since: datetime, until: datetime | None = None, workload: str | None = None
) -> dict[str, list]:
    """Per mode: acceptance rate at draft positions 1..MAX_K, the records' per-position rates weighted by
    their verification steps (sum of rate_i * passes / sum of passes). Positions beyond K are None."""
    return _per_position(_per_mode(endpoint_id=endpoint_id, since=since, until=until, workload=workload))


def accepted_length_histogram(
    *, endpoint_id: int, since: datetime, until: datetime | None = None, workload: str | None = None
) -> dict[str, list]:
    """Per mode: how many verification steps accepted 0, 1, ..., MAX_K draft tokens (summed lists)."""
    return _histogram(_per_mode(endpoint_id=endpoint_id, since=since, until=until, workload=workload))


ENDPOINT_GROUPS = ("mode", "action", "workload", "k")  # the key of endpoint_totals' rows


def endpoint_totals(*, endpoint_id: int, since: datetime, until: datetime | None = None) -> Totals:
    """One read for the endpoint page's figures beside its charts: sums per (mode, action, workload, K); pass it
    as `totals` to workloads_seen, measured_acceptance and costs.projection_vs_prod instead of a read each."""
    return sums(since=since, until=until or timezone.now(), group=ENDPOINT_GROUPS, endpoint_ids=[endpoint_id])


def regroup(totals: Totals, *, by: tuple[str, ...], actions: tuple[str, ...] | None = None) -> Totals:
    """endpoint_totals' rows summed again by some of ENDPOINT_GROUPS, keeping only `actions` (None: all)."""
    where = [ENDPOINT_GROUPS.index(name) for name in by]
    out: Totals = {}
    for key, row in totals.items():  # aggregated rows, not records
        if actions is not None and key[1] not in actions:
            continue
        into = out.setdefault(tuple(key[i] for i in where), dict.fromkeys(COLUMNS, 0))
        for column in COLUMNS:
            into[column] += row[column]
    return out


def workloads_seen(*, endpoint_id: int, since: datetime, limit: int = 50, totals: Totals | None = None) -> list[str]:
    """The workload keys of an endpoint's records since `since`, most requests first (the charts' filter)."""
    if totals is None:
        totals = sums(since=since, until=timezone.now(), group=["workload"], endpoint_ids=[endpoint_id])
    else:
        totals = regroup(totals, by=("workload",))
    ranked = sorted(((row["n"], key[0]) for key, row in totals.items() if key[0]), key=lambda t: (-t[0], t[1]))
    return [name for _, name in ranked[:limit]]


# --- summaries ----------------------------------------------------------------------------------------

SUMMARY_WINDOWS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}


def _window_summary(by_action: dict[str, dict[str, float]]) -> dict[str, Any]:
    def total(column: str, actions: tuple[str, ...] | None = None) -> float:
        return sum(row[column] for action, row in by_action.items() if actions is None or action in actions)

    prod, shadow = (Action.SPECULATED,), (Action.WOULD_SPECULATE,)
    return {
        "requests": int(total("n")),
        "speculated": int(total("n", prod)),
        "shadowed": int(total("n", shadow)),
        "skipped": int(total("n", (Action.SKIPPED,))),
        "fell_back": int(total("n", (Action.FELL_BACK,))),
        "acceptance_rate": ratio(total("accepted", SPECULATIVE_ACTIONS), total("drafted", SPECULATIVE_ACTIONS)),
        "alpha": ratio(total("alpha_sum", SPECULATIVE_ACTIONS), total("alpha_n", SPECULATIVE_ACTIONS)),
        "multiplier": ratio(total("mult_sum", prod), total("mult_n", prod)),
        "projected_multiplier": ratio(total("mult_sum", shadow), total("mult_n", shadow)),
        "tok_s": ratio(total("tok_s_sum", prod), total("tok_s_n", prod)),
        "baseline_tok_s": ratio(total("base_sum", prod), total("base_n", prod)),
    }


def range_summary(totals: Totals) -> dict[str, Any]:
    """fleet_summary's figures for one endpoint over endpoint_totals' rows (the endpoint page's key figures)."""
    return _window_summary({key[0]: row for key, row in regroup(totals, by=("action",)).items()})


def fleet_summary(*, endpoint_ids: list[int] | None = None, now: datetime | None = None) -> dict[int, dict]:
    """For each endpoint with records in the last day: {"hour": {...}, "day": {...}} with request counts
    per action, acceptance rate, alpha, measured (prod) and projected (shadow) multiplier, tok/s and
    baseline tok/s."""
    now = now or timezone.now()
    per_endpoint: dict[int, dict[str, dict]] = {}
    for name, span in SUMMARY_WINDOWS.items():
        totals = sums(since=now - span, until=now, group=["endpoint_id", "action"], endpoint_ids=endpoint_ids)
        for (endpoint_id, action), row in totals.items():
            per_endpoint.setdefault(endpoint_id, {w: {} for w in SUMMARY_WINDOWS})[name][action] = row
    return {
        endpoint_id: {name: _window_summary(by_action) for name, by_action in windows.items()}
        for endpoint_id, windows in sorted(per_endpoint.items())
    }


def measured_acceptance(
    *, endpoint_id: int, since: datetime, until: datetime | None = None, totals: Totals | None = None
) -> dict:
    """What shadow measured over a window: records, drafted/accepted tokens, acceptance rate, mean alpha,
    mean E[N], mean projected multiplier and the mean K the measurements used (`totals`: endpoint_totals')."""
    if totals is None:
        totals = sums(
            since=since, until=until or timezone.now(), endpoint_ids=[endpoint_id], actions=(Action.WOULD_SPECULATE,)
        )
    else:
        totals = regroup(totals, by=(), actions=(Action.WOULD_SPECULATE,))
    row = totals.get((), {})
    get = row.get
    return {
        "records": int(get("n_spec", 0)),
        "drafted": int(get("drafted", 0)),
        "accepted": int(get("accepted", 0)),
        "acceptance_rate": ratio(get("accepted", 0), get("drafted", 0)),
        "alpha": ratio(get("alpha_sum", 0), get("alpha_n", 0)),
        "mean_accepted_len": ratio(get("mal_sum", 0), get("mal_n", 0)),
        "projected_multiplier": ratio(get("mult_sum", 0), get("mult_n", 0)),
        "k": ratio(get("k_sum", 0), get("k_n", 0)),
    }


# --- records table ------------------------------------------------------------------------------------

RECORD_COLUMNS = (
    "id",
    "created_at",
    "request_id",
    "mode",
    "action",
    "workload",
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
    workload: str | None = None,
):
    """Newest first, filtered, only the columns the table shows (lazy: page it with `record_page`)."""
    qs = StageRecord.objects.filter(endpoint_id=endpoint_id)
    if workload is not None:
        qs = qs.filter(workload=workload)
    if action:
        qs = qs.filter(action=action)
    if mode:
        qs = qs.filter(mode=mode)
    if since:
        qs = qs.filter(created_at__gte=since)
    if until:
        qs = qs.filter(created_at__lte=until)
    return qs.only(*RECORD_COLUMNS).order_by("-created_at", "-id")


@dataclass(frozen=True)
class RecordPage:
    """One page of the records table, by keyset: `newer` / `older` are the record ids to page from (None at the
    ends). No COUNT(*): each page is one index range read, however many records the range holds."""

    object_list: list
    newer: int | None
    older: int | None


def record_page(records: Any, *, before: int | None = None, after: int | None = None, size: int = 25) -> RecordPage:
    """The `size` records of `records` (newest first, as stage_records orders them) just older than record `before`,
    just newer than record `after`, or the newest; an unknown cursor gives the newest page."""
    cursor = before if before is not None else after
    anchor = StageRecord.objects.filter(pk=cursor).values_list("created_at", flat=True).first() if cursor else None
    if anchor is None:
        rows = list(records[: size + 1])
        return RecordPage(rows[:size], None, rows[size - 1].pk if len(rows) > size else None)
    if before is not None:
        rows = list(records.filter(created_at__lte=anchor).exclude(created_at=anchor, id__gte=before)[: size + 1])
        return RecordPage(rows[:size], rows[0].pk if rows else None, rows[size - 1].pk if len(rows) > size else None)
    newer_first = records.filter(created_at__gte=anchor).exclude(created_at=anchor, id__lte=after)
    rows = list(newer_first.order_by("created_at", "id")[: size + 1])
    page = rows[:size][::-1]
    return RecordPage(page, page[0].pk if len(rows) > size else None, page[-1].pk if page else None)
