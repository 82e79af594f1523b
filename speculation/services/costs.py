"""Writes of measured step costs (CostCalibration): one row per calibration a GPU worker ran."""

from __future__ import annotations

from typing import Any

from speculation.engine.projection import StepCosts
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
