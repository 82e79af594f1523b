"""The StageRecord fields of one generation or replay, from the engine's SpecStats (the one set of counts).

Prod (speculation.worker.generation) and shadow (speculation.worker.shadow) both publish their stats through
``stage_fields``, so a shadow replay and the prod run it predicts are recorded with the same definitions:
- acceptance_rate = accepted / drafted (vLLM's draft acceptance rate);
- alpha = accepted / positions reached (the per-position acceptance of Leviathan et al.);
- mean_accepted_len = tokens committed per verification step that carried drafts, bonus token included
  (vLLM's 1 + accepted / drafts);
- per_position_acceptance[i] = steps whose draft i was accepted / steps that drafted a token at position i
  (vLLM's per-position counters over its number of drafts), listed up to K;
- accepted_length_hist[n] = steps that carried drafts and accepted n of them.
"""

from __future__ import annotations

from typing import Any

from speculation.engine.stats import SpecStats


def stage_fields(stats: SpecStats, *, k: int) -> dict[str, Any]:
    width = max(k, len(stats.drafted_per_position))
    accepted = _padded(stats.accepted_per_position, width)
    drafted = _padded(stats.drafted_per_position, width)
    return {
        "k": k,
        "target_passes": stats.target_passes,
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "per_position_acceptance": [a / d if d else 0.0 for a, d in zip(accepted, drafted, strict=True)],
        "accepted_length_hist": _padded(stats.accepted_length_histogram, width + 1),
        "acceptance_rate": stats.acceptance_rate if stats.drafted_tokens else None,
        "alpha": stats.alpha if any(stats.reached_per_position) else None,
        "mean_accepted_len": stats.mean_accepted_len if stats.drafts else None,
    }


def _padded(values: list[int], width: int) -> list[int]:
    return list(values) + [0] * (width - len(values))
