"""The step costs a GPU worker measured (CostCalibration) and the projection they give, for the pages and the API.

c = draft step / target step and v(K) = verify(K + 1 tokens) / target step, as speculation.worker.costs measured
them on the endpoint's node class (repeated timings, refreshed). `projection_vs_prod` puts shadow's
projected multiplier and prod's measured one side by side per K, from the per-K rollups (rollup_store.sums).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from speculation.engine.projection import MAX_PROJECTED_K, StepCosts, project
from speculation.models import Action, CostCalibration
from speculation.selectors.rollup_store import SPECULATIVE_ACTIONS, sums


def fresh_calibration(
    *, endpoint_id: int, node_class: str, path: str, draft_id: int | None, max_age_s: float
) -> CostCalibration | None:
    """The newest calibration of this endpoint, node class, path and draft younger than max_age_s."""
    return newest_calibration(
        endpoint_id=endpoint_id, node_class=node_class, path=path, draft_id=draft_id, max_age_s=max_age_s
    )


ANY_DRAFT = object()  # newest_calibration(draft_id=ANY_DRAFT): the server's costs, whichever draft was timed


def newest_calibration(
    *, endpoint_id: int, node_class: str, path: str, draft_id: Any, max_age_s: float | None = None
) -> CostCalibration | None:
    """The newest calibration of this endpoint, node class, path and draft (ANY_DRAFT: any), of any age unless
    max_age_s is given."""
    rows = CostCalibration.objects.filter(endpoint_id=endpoint_id, node_class=node_class, path=path)
    if draft_id is not ANY_DRAFT:
        rows = rows.filter(draft_id=draft_id)
    if max_age_s is not None:
        rows = rows.filter(measured_at__gte=timezone.now() - timedelta(seconds=max_age_s))
    return rows.order_by("-measured_at", "-id").first()


def projection_basis(row: CostCalibration, *, k: float) -> str:
    """How a projection from this calibration was made, for a shadow record's reason."""
    costs = row.step_costs()
    return (
        f"projection for the {row.path} path with c={costs.c:.3f}, v={costs.v(k):.3f} measured on {row.node_class} "
        f"at {row.measured_at:%H:%M:%S} ({row.repeats} timings each)"
    )


def latest_calibration(*, endpoint: Any) -> CostCalibration | None:
    """The newest calibration for the endpoint's current policy (its draft), on any path."""
    policy = getattr(endpoint, "policy", None)
    rows = CostCalibration.objects.filter(endpoint_id=endpoint.pk)
    if policy is not None and policy.pk:
        rows = rows.filter(draft_id=policy.draft_id)
    return rows.order_by("-measured_at", "-id").first()


def measured_costs(*, endpoint: Any, k: int | None = None) -> dict:
    """c, v at K (the policy's by default) and v per K, from the newest calibration; `missing` says what is not."""
    row = latest_calibration(endpoint=endpoint)
    if row is None:
        return {
            "calibrated": False,
            "c": None,
            "v": None,
            "v_per_k": {},
            "target_step_ms": (endpoint.capabilities or {}).get("tpot_ms"),
            "draft_step_ms": None,
            "missing": ["c and v: no calibration yet (the first shadow request queues one on the GPU worker)"],
        }
    costs = row.step_costs()
    policy = getattr(endpoint, "policy", None)
    k = k or (policy.k if policy is not None else 1)
    return {
        "calibrated": True,
        "c": round(costs.c, 4),
        "v": round(costs.v(k), 4),
        "v_per_k": {j: round(costs.v(j), 4) for j in range(1, MAX_PROJECTED_K + 1)},
        "target_step_ms": round(row.target_step_ms, 3),
        "draft_step_ms": round(row.draft_step_ms, 3),
        "path": row.path,
        "node_class": row.node_class,
        "measured_at": row.measured_at,
        "repeats": row.repeats,
        "missing": [],
    }


def projection(*, endpoint: Any, alpha: float | None, c: float | None = None, v: float | None = None) -> dict:
    """The curve S(K) for K = 1..8 from the measured alpha with the measured c and v(K), or a what-if c / v.

    `assumed` says when a number is not measured (a what-if, or v = 1 before any calibration)."""
    costs = measured_costs(endpoint=endpoint)
    c_used = c if c is not None else costs["c"]
    if v is not None:
        v_used, v_of = v, v
    elif costs["calibrated"]:
        v_used, v_of = costs["v"], step_costs(endpoint=endpoint).v
    else:
        v_used = v_of = 1.0
    curve = project(alpha=min(1.0, alpha), c=c_used, v=v_of) if alpha is not None and c_used is not None else []
    assumed = c is not None or v is not None or not costs["calibrated"]
    return {"costs": costs, "c": c_used, "v": v_used, "assumed": assumed, "curve": curve}


def step_costs(*, endpoint: Any) -> StepCosts | None:
    row = latest_calibration(endpoint=endpoint)
    return row.step_costs() if row is not None else None


def projection_vs_prod(*, endpoint: Any, since: datetime, alpha: float | None = None, totals: Any = None) -> list[dict]:
    """Per K: shadow's mean projected multiplier, prod's mean measured multiplier (each with its record count),
    their ratio, and the projection from the measured alpha and costs at that K (`totals`: rollups.endpoint_totals'
    rows for the same window, read once for the page)."""
    if totals is None:
        totals = sums(
            since=since,
            until=timezone.now(),
            group=["action", "k"],
            endpoint_ids=[endpoint.pk],
            actions=SPECULATIVE_ACTIONS,
        )
    else:
        from speculation.selectors.rollups import regroup

        totals = regroup(totals, by=("action", "k"), actions=SPECULATIVE_ACTIONS)
    by_k: dict[int, dict] = {}
    for (action, k), row in totals.items():  # from the rollups: one row per action and K
        if not k or not row["mult_n"]:
            continue
        side = "shadow" if action == Action.WOULD_SPECULATE else "prod"
        mean = round(row["mult_sum"] / row["mult_n"], 3)
        by_k.setdefault(k, {})[side] = {"n": int(row["mult_n"]), "multiplier": mean}
    costs = step_costs(endpoint=endpoint)
    curve = {p.k: p.multiplier for p in costs.curve(alpha=min(1.0, alpha))} if costs and alpha is not None else {}
    table = []
    for k in sorted(set(by_k) | set(curve)):
        shadow, prod = by_k.get(k, {}).get("shadow"), by_k.get(k, {}).get("prod")
        table.append(
            {
                "k": k,
                "shadow": shadow,
                "prod": prod,
                "ratio": round(shadow["multiplier"] / prod["multiplier"], 3) if shadow and prod else None,
                "curve": round(curve[k], 3) if k in curve else None,
                "v": round(costs.v(k), 3) if costs else None,
            }
        )
    return table
