"""Auto-pairing: per endpoint and workload, which candidate and K shadow's replays say would pay most.

Reads CandidateMeasurement rows (speculation.worker.candidates: every compatible candidate replayed at K = 1..8
on the same shadowed requests). Per workload x candidate and per K: the mean projected multiplier over the
requests; the best K is the one with the highest mean (the smallest K on a tie), and its interval is the normal
approximation mean +- Z * sd / sqrt(n) over the requests (n >= 2; each request is one draw of the multiplier, so
the interval narrows with the request count). The recommendation per workload is the cell with the highest mean;
it is `confident` when its interval's low end is above the runner-up's mean (a difference the evidence
resolves). "overall" pools every workload: the one choice a policy (one draft and K per endpoint) can apply.

Bounded work per view: the newest MAX_ROWS measured rows of the WINDOW are read (a few thousand, JSON lists of
eight numbers each), aggregated here.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from django.utils import timezone

from speculation.models import CandidateMeasurement, CandidateStatus

WINDOW = timedelta(days=7)
MAX_ROWS = 5000
Z = 1.96  # 95 % normal interval
MIN_REQUESTS = 5  # fewer measured requests: shown, never recommended
OVERALL = ""  # the key of the pooled row


@dataclass
class Cell:
    """One workload x candidate: the best K and its figures over the measured requests."""

    workload: str
    candidate: str
    kind: str
    draft_id: int | None
    requests: int = 0
    shed: int = 0
    best_k: int | None = None
    multiplier: float | None = None
    ci_low: float | None = None
    ci_high: float | None = None
    mean_accepted_len: float | None = None
    acceptance_rate: float | None = None  # accepted / drafted draft tokens at the best K
    per_k_multiplier: list[float | None] = field(default_factory=list)
    per_k_requests: list[int] = field(default_factory=list)  # measured requests per K (prod rows: one K each)


@dataclass
class Recommendation:
    workload: str
    candidate: str
    kind: str
    draft_id: int | None
    k: int
    multiplier: float
    ci_low: float | None
    ci_high: float | None
    requests: int
    runner_up: str | None
    runner_up_multiplier: float | None
    confident: bool


@dataclass
class _Acc:
    kind: str
    draft_id: int | None
    requests: int = 0
    shed: int = 0
    mult: list[list[float]] = field(default_factory=lambda: [[] for _ in range(8)])
    mal: list[float] = field(default_factory=lambda: [0.0] * 8)
    mal_n: list[int] = field(default_factory=lambda: [0] * 8)
    drafted: list[int] = field(default_factory=lambda: [0] * 8)
    accepted: list[int] = field(default_factory=lambda: [0] * 8)

    def add(self, row: dict) -> None:
        """One row: shadow's (every K) or prod's (the one K it ran: None elsewhere)."""
        if row["status"] != CandidateStatus.MEASURED:
            self.shed += row["status"] == CandidateStatus.SHED
            return
        self.requests += 1
        for i, value in enumerate((row["multiplier"] or [])[:8]):
            if value is not None:
                self.mult[i].append(float(value))
        for i, value in enumerate((row["mean_accepted_len"] or [])[:8]):
            if value is not None:
                self.mal[i] += float(value)
                self.mal_n[i] += 1
        for i, counts in enumerate((row["counts"] or [])[:8]):
            if counts:
                self.drafted[i] += counts[0]
                self.accepted[i] += counts[1]


def _cell(workload: str, candidate: str, acc: _Acc) -> Cell:
    means = [sum(values) / len(values) if values else None for values in acc.mult]
    cell = Cell(workload, candidate, acc.kind, acc.draft_id, requests=acc.requests, shed=acc.shed)
    cell.per_k_multiplier = [round(m, 4) if m is not None else None for m in means]
    cell.per_k_requests = [len(values) for values in acc.mult]
    known = [(m, k) for k, m in enumerate(means, start=1) if m is not None]
    if not known:
        return cell
    best, k = max(known, key=lambda t: (t[0], -t[1]))
    values = acc.mult[k - 1]
    cell.best_k, cell.multiplier = k, round(best, 4)
    if len(values) >= 2:
        half = Z * math.sqrt(sum((v - best) ** 2 for v in values) / (len(values) - 1)) / math.sqrt(len(values))
        cell.ci_low, cell.ci_high = round(best - half, 4), round(best + half, 4)
    cell.mean_accepted_len = round(acc.mal[k - 1] / acc.mal_n[k - 1], 4) if acc.mal_n[k - 1] else None
    drafted = acc.drafted[k - 1]
    cell.acceptance_rate = round(acc.accepted[k - 1] / drafted, 4) if drafted else None
    return cell


def recommend(workload: str, cells: list[Cell]) -> Recommendation | None:
    """The best of `cells` by projected multiplier (MIN_REQUESTS measured at least), or None."""
    ranked = sorted(
        (c for c in cells if c.multiplier is not None and c.requests >= MIN_REQUESTS),
        key=lambda c: (-c.multiplier, c.candidate),
    )
    if not ranked:
        return None
    best, runner = ranked[0], (ranked[1] if len(ranked) > 1 else None)
    confident = runner is None or (best.ci_low is not None and best.ci_low > runner.multiplier)
    return Recommendation(
        workload=workload,
        candidate=best.candidate,
        kind=best.kind,
        draft_id=best.draft_id,
        k=best.best_k,
        multiplier=best.multiplier,
        ci_low=best.ci_low,
        ci_high=best.ci_high,
        requests=best.requests,
        runner_up=runner.candidate if runner else None,
        runner_up_multiplier=runner.multiplier if runner else None,
        confident=confident,
    )


def pairing_table(*, endpoint_id: int, since: datetime | None = None) -> dict:
    """{"workloads": {workload: {"cells": [Cell...], "recommendation": Recommendation | None}}, "overall": {...}}
    with "" as the overall key's workload; workloads ordered by measured requests, most first."""
    since = since or timezone.now() - WINDOW
    rows = (
        CandidateMeasurement.objects.filter(endpoint_id=endpoint_id, created_at__gte=since)
        .order_by("-created_at", "-id")
        .values(*ROW_FIELDS)[:MAX_ROWS]
    )
    return table_from_rows(rows)


ROW_FIELDS = (
    "workload", "candidate", "kind", "draft_id", "status", "multiplier", "mean_accepted_len", "counts",
)  # fmt: skip


def table_from_rows(rows: Iterable[dict]) -> dict:
    """pairing_table's aggregation of CandidateMeasurement rows given as dicts of ROW_FIELDS (benchmarks feed
    their own replays through it, so they apply the product's rule to the same figures)."""
    accs: dict[tuple[str, str], _Acc] = {}
    for row in rows:
        for workload in (row["workload"], OVERALL):
            key = (workload, row["candidate"])
            if key not in accs:
                accs[key] = _Acc(kind=row["kind"], draft_id=row["draft_id"])
            accs[key].add(row)
    grouped: dict[str, list[Cell]] = defaultdict(list)
    for (workload, candidate), acc in accs.items():
        grouped[workload].append(_cell(workload, candidate, acc))
    table = {
        workload: {"cells": sorted(cells, key=lambda c: c.candidate), "recommendation": recommend(workload, cells)}
        for workload, cells in grouped.items()
    }
    overall = table.pop(OVERALL, {"cells": [], "recommendation": None})
    order = sorted(table, key=lambda w: (-max(c.requests for c in table[w]["cells"]), w))
    return {"workloads": {w: table[w] for w in order}, "overall": overall}


# --- draft: auto in prod: each request's candidate and K ------------------------------------------------------

PROD_MIN_REQUESTS = 3  # measured requests, every workload pooled, before the evidence replaces the policy's pairing
PRIOR_REQUESTS = 2.0  # a workload's own mean is shrunk toward the pooled one as if the pooled had this many requests


@dataclass(frozen=True)
class Choice:
    """The candidate and K one prod request runs with, and why (the stage record's reason)."""

    candidate: str
    kind: str
    draft_id: int | None
    k: int
    reason: str
    from_evidence: bool  # False: the policy's own draft and K


@dataclass(frozen=True)
class _Estimate:
    value: float
    cell: Cell  # the pooled cell
    k: int
    own_requests: int  # the workload's measured requests at this K
    own_mean: float | None


def shrunk_estimates(table: dict, *, workload: str, kinds: frozenset[str] | None = None) -> list[_Estimate]:
    """Every (candidate, K) that can run (`kinds`; None: any) with a pooled mean: the workload's own mean at that K
    shrunk toward the pooled one, (n * own + PRIOR_REQUESTS * pooled) / (n + PRIOR_REQUESTS), n its own requests.

    Why shrink: a workload with a few requests has a noisy mean per cell, and the highest of 32 noisy means is
    biased up (the winner's curse), so its own evidence counts in proportion to its amount; the pooled mean is
    the best guess before any (every candidate is replayed on every shadowed request, so all cells fill at once)."""
    own = {c.candidate: c for c in (table["workloads"].get(workload) or {}).get("cells", [])} if workload else {}
    found = []
    for pooled in table["overall"].get("cells", []):
        if kinds is not None and pooled.kind not in kinds:
            continue
        mine = own.get(pooled.candidate)
        for k, prior in enumerate(pooled.per_k_multiplier, start=1):
            if prior is None:
                continue
            n = mine.per_k_requests[k - 1] if mine and mine.per_k_requests else 0
            mean = mine.per_k_multiplier[k - 1] if n else None
            value = (n * mean + PRIOR_REQUESTS * prior) / (n + PRIOR_REQUESTS) if mean is not None else prior
            found.append(_Estimate(value, pooled, k, n, mean))
    return found


def workload_choice(table: dict, *, workload: str, current: Choice, kinds: frozenset[str] | None = None) -> Choice:
    """The rule prod's `draft: auto` applies per request (`current`: the policy's own candidate and K).

    - Until PROD_MIN_REQUESTS requests are measured (every workload pooled), the policy's draft and K.
    - Then the (candidate, K) with the highest shrunk estimate for the request's workload (shrunk_estimates: its
      own mean pulled toward the pooled one by PRIOR_REQUESTS), among the candidates that can run on the path.
      A new workload runs the pooled winner; one with evidence of its own moves to its own winner as fast as
      that evidence outweighs the pooled mean. Ties go to the smaller K, then the policy's candidate.

    This is follow-the-leader on full information: shadow replays every candidate on every request, so nothing is
    learnt by exploring, and the choice per request needs no hysteresis (the policy's own pairing, which an
    operator sees in the history, moves only with significance: speculation.services.autopairing.auto_decision)."""
    pooled = max((c.requests for c in table["overall"].get("cells", [])), default=0)
    label = workload or "no workload"
    if pooled < PROD_MIN_REQUESTS:
        return replace(
            current,
            reason=f"auto: {pooled} measured requests (needs {PROD_MIN_REQUESTS}): the policy's "
            f"{current.candidate} K={current.k}",
        )
    estimates = shrunk_estimates(table, workload=workload, kinds=kinds)
    if not estimates:
        return replace(current, reason=f"auto: no measured candidate can run here: the policy's {current.candidate}")
    best = max(estimates, key=lambda e: (round(e.value, 6), -e.k, e.cell.candidate == current.candidate))
    cell = best.cell
    own = (
        f"{best.own_requests} {label} requests at {best.own_mean:.2f}x"
        if best.own_mean is not None
        else f"no {label} requests yet"
    )
    prior = cell.per_k_multiplier[best.k - 1]
    return Choice(
        cell.candidate,
        cell.kind,
        cell.draft_id,
        best.k,
        f"auto: {label} -> {cell.candidate} K={best.k}, projected {best.value:.2f}x ({own}; "
        f"{cell.per_k_requests[best.k - 1]} requests pooled at {prior:.2f}x)",
        from_evidence=True,
    )
