"""Applying auto-pairing's recommendation: the endpoint's policy takes the recommended candidate and K.

Through the policy service (validated as a whole, the change recorded with who made it). A policy holds one draft
and one K per endpoint, so the overall recommendation (every workload pooled) is what applies by default; naming
a workload applies that workload's winner to the whole endpoint.
"""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError

from fleet.models import Endpoint
from speculation.models import DraftKind, DraftModel, SpeculationPolicy
from speculation.selectors.autopairing import MIN_REQUESTS, Recommendation, pairing_table
from speculation.services.policies import update_policy


def recommendation_for(*, endpoint: Endpoint, workload: str | None = None) -> Recommendation:
    """The recommendation to apply (ValidationError on `workload` saying why there is none)."""
    table = pairing_table(endpoint_id=endpoint.pk)
    entry = table["overall"] if not workload else table["workloads"].get(workload)
    if entry is None:
        raise ValidationError({"workload": [f"no candidate measurements for workload {workload!r} on {endpoint.name}"]})
    recommendation = entry["recommendation"]
    if recommendation is None:
        raise ValidationError(
            {
                "workload": [
                    f"not enough evidence yet: a candidate needs {MIN_REQUESTS} measured shadow requests "
                    "with a projected multiplier"
                ]
            }
        )
    return recommendation


def apply_recommendation(
    *, endpoint: Endpoint, user: AbstractBaseUser | None, workload: str | None = None
) -> tuple[SpeculationPolicy, Recommendation]:
    """Set the policy's mechanism, draft and K to the recommendation's (nothing saved when it would be invalid)."""
    recommendation = recommendation_for(endpoint=endpoint, workload=workload)
    draft = None
    if recommendation.kind != DraftKind.NGRAM:
        draft = DraftModel.objects.filter(pk=recommendation.draft_id).first()
        if draft is None:
            raise ValidationError({"draft": [f"draft {recommendation.candidate!r} is no longer registered"]})
    policy = update_policy(endpoint=endpoint, user=user, mechanism=recommendation.kind, draft=draft, k=recommendation.k)
    return policy, recommendation
