"""Writes of measured step costs (CostCalibration): one row per calibration a GPU worker ran."""

from __future__ import annotations

from typing import Any

from speculation.engine.projection import StepCosts
from speculation.limits import tree_nodes_at
from speculation.models import CostCalibration, DraftModel


def record_calibration(
    *, endpoint: Any, draft: DraftModel | None, path: str, costs: StepCosts, repeats: int, context_tokens: int
) -> CostCalibration:
    """Keep one calibration (seconds in, milliseconds stored) for the pages and the next shadow measurements."""
    return CostCalibration.objects.create(
        endpoint=endpoint,
        draft=draft,
        node_class=endpoint.node_class,
        path=path,
        target_step_ms=costs.target_step_s * 1000.0,
        draft_step_ms=costs.draft_step_s * 1000.0,
        verify_ms={str(n): s * 1000.0 for n, s in sorted(costs.verify_s.items())},
        repeats=repeats,
        context_tokens=context_tokens,
    )


PENDING_WINDOW_S = 3600  # records older than this that still wait for a calibration stay without a projection


def project_pending_records(*, calibration: CostCalibration, tag: str, pending: str) -> int:
    """Fill in the projection of the endpoint's shadow records that were made before any calibration of this key
    existed (their reason holds `pending` and the key's tag): S = E[N] / (v(K) + K c) with E[N] and K as the
    record counted them, exactly as shadow would have projected then. Returns how many were projected."""
    from datetime import timedelta

    from django.utils import timezone

    from speculation.models import Action, SpeculationPolicy, StageRecord
    from speculation.selectors.costs import projection_basis

    rows = StageRecord.objects.filter(
        endpoint_id=calibration.endpoint_id,
        action=Action.WOULD_SPECULATE,
        multiplier__isnull=True,
        reason__contains=f"{pending} [{tag}]",
        created_at__gte=timezone.now() - timedelta(seconds=PENDING_WINDOW_S),
    )
    costs = calibration.step_costs()
    tree = (
        SpeculationPolicy.objects.filter(endpoint_id=calibration.endpoint_id)
        .values_list("eagle_tree", flat=True)
        .first()
    ) or {}  # fmt: skip
    done = 0
    for record in rows:
        k = record.drafted_tokens / record.target_passes if record.target_passes else float(record.k or 0)
        head = record.reason.split(pending, 1)[0]
        verified = _tree_verified(record, head, tree, k)
        per_pass = (
            1.0 + (record.accepted_tokens or 0) / record.target_passes
            if record.target_passes
            else record.mean_accepted_len or 1.0
        )  # tokens per target pass, steps that drafted nothing included (SpecStats.tokens_per_pass)
        multiplier = costs.multiplier(tokens_per_step=per_pass, k=k, verified=verified)
        record.multiplier = multiplier
        record.tok_s = record.baseline_tok_s * multiplier if record.baseline_tok_s else None
        record.reason = f"{head}{projection_basis(calibration, k=k)}, stored after this record"
        record.server_step_ms = calibration.target_step_ms
        record.save(update_fields=["multiplier", "tok_s", "reason", "server_step_ms"])
        done += 1
    return done


TREE_REPLAY = "drafting the tree"  # in the reason of a shadow record of a head replayed as the policy's draft tree


def _tree_verified(record: Any, head: str, tree: dict, k: float) -> float | None:
    """A tree replay's drafts per verification, as shadow's on-time projection counts them (every node of the
    policy's tree at depth min(depth, K), per drafting level); None for a chain (K + 1 tokens verified)."""
    if TREE_REPLAY not in head or not tree or not record.k:
        return None
    depth = min(tree["depth"], record.k)
    return k * tree_nodes_at(tree["top_k"], tree["depth"], tree["nodes"], record.k) / depth
