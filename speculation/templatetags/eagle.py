"""Template tags for the EAGLE / native-path includes: launch flags of an endpoint, recent training runs."""

from __future__ import annotations

from django import template

from speculation.models import TrainingRun
from speculation.selectors import native_flags
from speculation.selectors.drafts import visible_runs

register = template.Library()


@register.simple_tag
def native_flags_for(endpoint) -> dict:
    """{"flags": NativeFlags} for the endpoint's policy draft, or {"reason": why there are none}."""
    try:
        return {"flags": native_flags.flags_for_endpoint(endpoint=endpoint)}
    except native_flags.NativeFlagsError as exc:
        return {"reason": str(exc)}


@register.simple_tag
def recent_training_runs(user, limit: int = 10) -> list[TrainingRun]:
    """The user's latest runs: those it may see (its own, its teams', every one for admins)."""
    return list(visible_runs(user)[:limit])
