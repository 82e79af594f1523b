"""The cost model of an endpoint's policy, from what was measured (rules.CostModel): the step costs of the newest
calibration on prod's path (speculation.selectors.costs), and from the policy's newest records E[N] (tokens per
verification, shadow's and prod's on the same path) and the setup a prod request on that path costs beyond its
steps (its latency less its verifications). Read from the database at most once per COSTS_TTL_S per process;
None until both are measured."""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from django.db import DatabaseError
from django.db.models import Q

from speculation.gateway.db import read
from speculation.gateway.guard.rules import CostModel

logger = logging.getLogger(__name__)

COSTS_TTL_S = 60.0
RECORDS = 50  # the newest records of the policy E[N] and the setup are measured over
_models: dict[tuple[Any, ...], tuple[float, CostModel | None]] = {}


async def cost_model(route: Any) -> CostModel | None:
    """The route's cost model, or None where nothing speculates (no path or K) or it is not measured yet."""
    k, path = getattr(route, "k", 0), getattr(route, "path", "")
    if not k or not path:
        return None
    key = (route.endpoint_id, route.node_class, path, route.draft_id, k, getattr(route, "mechanism", ""))
    now = time.monotonic()
    found = _models.get(key)
    if found is not None and now - found[0] < COSTS_TTL_S:
        return found[1]
    try:
        model = await read(measure, *key)
    except DatabaseError as exc:  # no cost model: the load's rule decides
        logger.warning("goodput guard: costs unreadable (%s)", exc)
        model = None
    _models[key] = (now, model)
    return model


def forget() -> None:
    _models.clear()


def measure(
    endpoint_id: int, node_class: str, path: str, draft_id: int | None, k: int, mechanism: str = ""
) -> CostModel | None:
    from speculation.models import Action, StageRecord
    from speculation.selectors.costs import newest_calibration

    calibration = newest_calibration(endpoint_id=endpoint_id, node_class=node_class, path=path, draft_id=draft_id)
    if calibration is None:
        return None
    # shadow's replays (which project for prod's path) and prod's own records on this path, of this mechanism:
    # another path's latency (the remote path's scoring calls) or another drafter's steps are not this one's
    same = Q(mechanism=mechanism) if mechanism else Q()
    records = list(
        StageRecord.objects.filter(
            Q(action=Action.WOULD_SPECULATE) | Q(action=Action.SPECULATED, path=path),
            same,
            endpoint_id=endpoint_id,
            target_passes__gt=0,
        )
        .order_by("-created_at", "-id")
        .values_list("action", "target_passes", "accepted_tokens", "drafted_tokens", "latency_ms")[:RECORDS]
    )
    prod = [r for r in records if r[0] == Action.SPECULATED and r[4]]
    if not prod:
        return None
    costs = calibration.step_costs()
    passes = sum(r[1] for r in records)
    drafts = sum(r[3] for r in records) / passes or float(k)
    step_s = costs.v(drafts) * costs.target_step_s + drafts * costs.draft_step_s
    setup_s = statistics.median(max(0.0, latency_ms / 1000.0 - n * step_s) for _, n, _, _, latency_ms in prod)
    return CostModel(
        target_step_s=costs.target_step_s,
        c=costs.c,
        v=costs.v(drafts),
        k=round(drafts, 1),
        tokens_per_step=1.0 + sum(r[2] for r in records) / passes,
        setup_s=setup_s,
    )
