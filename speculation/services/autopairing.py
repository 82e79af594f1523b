"""Applying auto-pairing's recommendation: the endpoint's policy takes the recommended candidate and K.

Through the policy service (validated as a whole, the change recorded with who made it). A policy holds one draft
and one K per endpoint, so the overall recommendation (every workload pooled) is what applies by default; naming
a workload applies that workload's winner to the whole endpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import ValidationError

from fleet.managed.models import ManagedServer
from fleet.models import Endpoint
from speculation import drafting
from speculation.models import (
    DraftKind,
    DraftModel,
    SpeculationPolicy,
    TrainingRun,
    VerificationPath,
)
from speculation.selectors.autopairing import MIN_REQUESTS, OVERALL, Recommendation, pairing_table, recommend
from speculation.selectors.drafts import drafts_usable_by, visible_drafts
from speculation.services.policies import resolve_path, runnable_mechanisms, update_policy

logger = logging.getLogger(__name__)


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
    if not drafting.for_kind(recommendation.kind).looks_up:
        # Among the drafts the endpoint may use and the user may see: another team's reads as gone.
        usable = drafts_usable_by(endpoint)
        if user is not None:
            usable = usable.filter(pk__in=visible_drafts(user).values("pk"))
        draft = usable.filter(pk=recommendation.draft_id).first()
        if draft is None:
            raise ValidationError({"draft": [f"draft {recommendation.candidate!r} is no longer registered"]})
    policy = update_policy(endpoint=endpoint, user=user, mechanism=recommendation.kind, draft=draft, k=recommendation.k)
    return policy, recommendation


# --- draft: auto ----------------------------------------------------------------------------------------------

AUTO_MIN_REQUESTS = 20  # measured requests the winner needs before ACE switches on its own
AUTO_MARGIN = 0.05  # the winner's interval must clear the current choice's projection by this fraction


def auto_decision(
    *, policy: SpeculationPolicy, table: dict, runnable: frozenset[str] | None = None
) -> tuple[Recommendation | None, str]:
    """(the recommendation to apply, why) or (None, why not): the pooled winner among the `runnable` mechanisms
    (None: all) must differ from the current pairing, rest on AUTO_MIN_REQUESTS requests, and its interval's low
    end must beat the current pairing's projected multiplier by AUTO_MARGIN (hysteresis: a noisy lead does not
    flip the policy back and forth)."""
    recommendation = table["overall"]["recommendation"]
    if runnable is None or recommendation is None or recommendation.kind in runnable:
        return _decide(policy, table, recommendation)
    passed_over = (
        f" ({recommendation.candidate} leads at {recommendation.multiplier:.2f}x but cannot run on this endpoint's "
        "path)"
    )
    chosen, why = _decide(
        policy, table, recommend(OVERALL, [c for c in table["overall"]["cells"] if c.kind in runnable])
    )
    return chosen, why + passed_over


def _decide(
    policy: SpeculationPolicy, table: dict, recommendation: Recommendation | None
) -> tuple[Recommendation | None, str]:
    if recommendation is None:
        return None, "no recommendation yet"
    current = drafting.for_kind(policy.mechanism).candidate_name(policy.draft)
    if recommendation.candidate == current and recommendation.k == policy.k:
        return None, f"the current pairing ({current}, K = {policy.k}) is the winner"
    if recommendation.requests < AUTO_MIN_REQUESTS:
        return None, f"{recommendation.requests} measured requests; auto needs {AUTO_MIN_REQUESTS}"
    cell = next((c for c in table["overall"]["cells"] if c.candidate == current), None)
    now = cell.per_k_multiplier[policy.k - 1] if cell and 0 < policy.k <= len(cell.per_k_multiplier) else None
    evidence = (
        f"{recommendation.candidate} at K = {recommendation.k} projects {recommendation.multiplier:.2f}x "
        f"[{recommendation.ci_low}, {recommendation.ci_high}] over {recommendation.requests} requests"
    )
    if now is not None:
        evidence += f" vs {current} at K = {policy.k} {now:.2f}x"
        if recommendation.ci_low is None or recommendation.ci_low <= now * (1 + AUTO_MARGIN):
            return None, f"not clearly better: {evidence} (needs an interval above {now * (1 + AUTO_MARGIN):.2f}x)"
    elif not recommendation.confident:
        return None, f"not yet significant: {evidence}"
    return recommendation, evidence


def _scope(policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """What the pooled winner is for on this endpoint (said in the change history)."""
    if resolve_path(policy=policy, endpoint=endpoint) == VerificationPath.NATIVE:
        managed = " managed" if ManagedServer.objects.filter(endpoint=endpoint).exists() else ""
        return (
            f"native path on a{managed} endpoint (one server configuration at a time, not per request): "
            "the endpoint's best overall, every workload pooled"
        )
    return "the endpoint's best overall (what prod runs where a workload's own evidence is short)"


def trained_on(draft: DraftModel | None) -> str:
    """What a draft was trained on, for the change history: its training run and the run's prompt sources
    (`captured:<endpoint id>[:<workload>]` for an endpoint's captured traffic) and the head it continued from (a warm
    start); "" when no run registered it."""
    run = TrainingRun.objects.filter(draft=draft).order_by("-pk").first() if draft is not None else None
    if run is None:
        return ""
    start = run.config.get("init_from") or ""
    return f"training run {run.pk} on {run.prompts}" + (f", continued from {head_name(start)}" if start else "")


def head_name(directory: str) -> str:
    """The registered name of the EAGLE head or draft model in a directory (a warm start's), else the directory."""
    heads = DraftModel.objects.filter(kind__in=(DraftKind.EAGLE_HEAD, DraftKind.DRAFT_MODEL)).order_by("pk")
    return next((d.name for d in heads if Path(d.path).resolve() == Path(directory).resolve()), directory)


def auto_apply(*, endpoint: Endpoint) -> SpeculationPolicy | None:
    """For a `draft: auto` policy, apply the winner when auto_decision says so; the change is recorded with
    changed_by empty and {"auto": [None, evidence]}. Returns the changed policy, or None when nothing changed."""
    policy = SpeculationPolicy.objects.select_related("draft").filter(endpoint=endpoint).first()
    if policy is None or not policy.auto_pairing:
        return None
    runnable = runnable_mechanisms(policy=policy, endpoint=endpoint)
    recommendation, why = auto_decision(policy=policy, table=pairing_table(endpoint_id=endpoint.pk), runnable=runnable)
    if recommendation is None:
        logger.info("auto-pairing of %s: no switch (%s)", endpoint.name, why)
        return None
    why = f"{_scope(policy, endpoint)}: {why}"
    draft = None
    if not drafting.for_kind(recommendation.kind).looks_up:
        draft = drafts_usable_by(endpoint).filter(pk=recommendation.draft_id).first()
    trained = trained_on(draft)  # a head trained on the endpoint's captured traffic says so in the history
    try:
        return update_policy(
            endpoint=endpoint,
            user=None,
            note={"auto": [None, why], **({"trained_on": [None, trained]} if trained else {})},
            mechanism=recommendation.kind,
            draft=draft,
            k=recommendation.k,
        )
    except ValidationError as exc:  # e.g. the draft was deleted meanwhile: stay, say why
        logger.warning("auto-pairing of %s: switch refused: %s", endpoint.name, "; ".join(exc.messages))
        return None
