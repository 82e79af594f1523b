"""Speculation policy per endpoint: read, validate, change (every change kept with who and when)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from fleet.managed import services as managed_services
from fleet.models import Endpoint, EndpointStatus
from speculation import drafting
from speculation.limits import K_MAX, K_MIN, tree_shape_problems
from speculation.models import (
    DraftModel,
    Mechanism,
    Mode,
    PolicyChange,
    SpeculationPolicy,
    VerificationPath,
)
from speculation.selectors import capabilities, native_flags
from speculation.services import model_files, target_identity
from speculation.services.path_choice import choose_path

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

logger = logging.getLogger(__name__)

EDITABLE_FIELDS = (
    "mode",
    "mechanism",
    "draft",
    "k",
    "dynamic_k",
    "eagle_tree",
    "auto_pairing",
    "shadow_sample_rate",
    "path",
    "target_path",
)


def get_policy(*, endpoint: Endpoint) -> SpeculationPolicy:
    """The endpoint's policy; an endpoint that never had one is off (the default is created on first read)."""
    policy, _ = SpeculationPolicy.objects.get_or_create(endpoint=endpoint)
    return policy


def resolve_path(*, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """The verification path prod uses: the override, or what auto was resolved to when the policy was last
    saved or re-evaluated (speculation.services.path_choice); "" if none fits. A re-probe does not change it."""
    if policy.path != VerificationPath.AUTO:
        return policy.path
    if policy.path_resolved_at is None:  # saved before paths were resolved on save: choose now
        return choose_path(policy=policy, endpoint=endpoint).path
    return policy.resolved_path


def _fresh_path(policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """The path this policy would run on if saved now (auto: chosen afresh by speed)."""
    if policy.path != VerificationPath.AUTO:
        return policy.path
    return choose_path(policy=policy, endpoint=endpoint).path


def _resolve_on_save(policy: SpeculationPolicy, endpoint: Endpoint, changes: dict[str, list[Any]]) -> None:
    """Fix what auto means now, recording the choice and its evidence in the change when it moves."""
    if policy.path != VerificationPath.AUTO:
        return
    choice = choose_path(policy=policy, endpoint=endpoint)
    if choice.path != policy.resolved_path or policy.path_resolved_at is None:
        changes["resolved_path"] = [policy.resolved_path or None, choice.path or None]
        changes["path_evidence"] = [None, choice.summary()]
    policy.resolved_path = choice.path
    policy.path_evidence = choice.as_json()
    policy.path_resolved_at = timezone.now()


def reevaluate_path(*, endpoint: Endpoint, user: AbstractBaseUser | None = None) -> SpeculationPolicy:
    """Choose auto's path again from the latest probe and measurements (an explicit action, recorded like any
    policy change). Refused (ValidationError) when prod would be left without a path."""
    with transaction.atomic():
        policy = get_policy(endpoint=endpoint)
        policy = SpeculationPolicy.objects.select_for_update(of=("self",)).select_related("draft").get(pk=policy.pk)
        if policy.path != VerificationPath.AUTO:
            raise ValidationError({"path": [f"the path is fixed to {policy.path}: nothing to re-evaluate"]})
        changes: dict[str, list[Any]] = {}
        _resolve_on_save(policy, endpoint, changes)
        if policy.mode == Mode.PROD and not policy.resolved_path:
            raise ValidationError({"path": _check_path(policy, endpoint) or ["no verification path fits"]})
        actor = user if user is not None and user.is_authenticated else None
        policy.save(update_fields=["resolved_path", "path_evidence", "path_resolved_at", "updated_at"])
        if changes:
            PolicyChange.objects.create(policy=policy, changed_by=actor, changes=changes)
    logger.info("path of %s re-evaluated by %s: %s", endpoint.name, actor or "system", changes or "unchanged")
    return policy


def path_warning(*, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """What a re-probe (or new measurements) changed that the saved path does not follow yet ("" if nothing)."""
    if policy.path != VerificationPath.AUTO or policy.path_resolved_at is None:
        if policy.path == VerificationPath.AUTO or policy.mode != Mode.PROD:
            return ""
        problems = _check_path(policy, endpoint)
        return f"the fixed path {policy.path} no longer fits: {'; '.join(problems)}" if problems else ""
    fresh = choose_path(policy=policy, endpoint=endpoint).path
    if fresh == policy.resolved_path:
        return ""
    return (
        f"auto is fixed to {policy.resolved_path or 'no path'} (chosen {policy.path_resolved_at:%Y-%m-%d %H:%M}); "
        f"with the latest probe and measurements it would choose {fresh or 'no path'}. Re-evaluate to apply."
    )


def _check_draft(policy: SpeculationPolicy, endpoint: Endpoint) -> list[str]:
    """Why the draft cannot serve this endpoint (empty when it can)."""
    mechanism = drafting.for_kind(policy.mechanism)
    if mechanism.looks_up:
        if policy.draft is not None and policy.draft.kind != policy.mechanism:
            return [
                f"mechanism {policy.mechanism} takes no draft weights, but draft {policy.draft.name!r} is a "
                f"{policy.draft.kind}"
            ]
        return []
    draft = policy.draft
    if draft is None:
        return [f"mechanism {policy.mechanism} needs a registered draft"]
    if draft.kind != mechanism.draft_kind:
        return [f"draft {draft.name!r} is a {draft.kind}, not a {mechanism.draft_kind}"]
    endpoint_fp = capabilities.tokenizer_fingerprint(endpoint)
    if not endpoint_fp:
        return ["the endpoint's tokenizer fingerprint is unknown: probe the endpoint first"]
    if not draft.tokenizer_fingerprint:
        return [f"draft {draft.name!r} has no tokenizer fingerprint"]
    if draft.tokenizer_fingerprint != endpoint_fp:
        return [
            f"draft {draft.name!r} tokenizer fingerprint {draft.tokenizer_fingerprint[:12]} does not match the "
            f"endpoint's {endpoint_fp[:12]}: the draft must share the target's tokenizer"
        ]
    return []


def _check_path(policy: SpeculationPolicy, endpoint: Endpoint) -> list[str]:
    path = _fresh_path(policy, endpoint)
    if not path and policy.path == VerificationPath.AUTO:
        return [f"no verification path fits this endpoint ({choose_path(policy=policy, endpoint=endpoint).summary()})"]
    if not path:
        return [
            "no verification path fits this endpoint: it neither speculates itself nor scores token-id "
            "prompts (probe it, or set path=local with a target_path)"
        ]
    if path == VerificationPath.NATIVE and not capabilities.native_speculation(endpoint):
        return ["path native needs a server that speculates itself (the probe found no speculative decoding)"]
    if path == VerificationPath.REMOTE and not capabilities.can_score_token_prompts(endpoint):
        return [
            "path remote needs an endpoint that scores token-id prompts by token id (vLLM prompt_logprobs, SGLang "
            "return_logprob); the probe found none"
        ]
    if path == VerificationPath.LOCAL and not policy.target_path:
        return ["path local needs target_path: the target's model directory on the node class"]
    problem = _mechanism_problem(policy.mechanism, path, endpoint, policy.draft)
    return [problem] if problem else []


def _mechanism_problem(mechanism: str, path: str, endpoint: Endpoint, draft=None) -> str | None:
    """Why `mechanism` (with `draft`, where named) cannot run on `path` of this endpoint, or None (an unknown
    mechanism is refused by validation, with its own message)."""
    known = drafting.MECHANISMS.get(mechanism)
    if known is None:
        return None
    return known.path_problem(
        path,
        managed=lambda: _managed(endpoint),
        head_problem=lambda: native_flags.head_problem(server_kind=endpoint.kind, draft=draft),
    )


def runnable_mechanisms(*, policy: SpeculationPolicy, endpoint: Endpoint) -> frozenset[str]:
    """The mechanisms this policy could switch to on this endpoint: those the path it would run on can run
    (checked in every mode: what prod would run), e.g. on path native neither the hybrid nor an EAGLE head, on a
    managed server no suffix. Whether the path itself fits the endpoint is validation's business, not the
    candidate's: a mechanism with no path at all is left out only where another has one."""
    runnable, pathless = set(), set()
    for mechanism in Mechanism.values:
        trial = copy.copy(policy)  # never saved
        trial.mechanism = mechanism
        path = _fresh_path(trial, endpoint)
        if not path:
            pathless.add(mechanism)
        elif _mechanism_problem(mechanism, path, endpoint, trial.draft) is None:
            runnable.add(mechanism)
    return frozenset(runnable or pathless)


def _managed(endpoint: Endpoint) -> bool:
    from fleet.managed.models import ManagedServer

    return ManagedServer.objects.filter(endpoint=endpoint).exists()


def _check_tree(policy: SpeculationPolicy) -> dict[str, list[str]]:
    """A draft tree is a valid shape, for an EAGLE head (a draft model or n-gram lookup drafts a chain)."""
    problems = tree_shape_problems(policy.eagle_tree)
    if not problems and policy.eagle_tree and not drafting.drafts_trees(policy.mechanism):
        problems = [f"eagle_tree drafts with an EAGLE head: mechanism {policy.mechanism} drafts a chain (send {{}})"]
    return {"eagle_tree": problems} if problems else {}


def _check_target_path(policy: SpeculationPolicy, endpoint: Endpoint, *, identity: bool) -> None:
    """In every mode: target_path is a model of a family the engine runs, under the model roots, with the endpoint's
    tokenizer; with `identity`, one that reproduces the endpoint's served model (speculation.services.target_identity).

    Stores the canonical path (symlinks resolved) on the policy.
    """
    facts = model_files.inspect_model_dir(policy.target_path, field="target_path", llama=True)
    endpoint_fp = capabilities.tokenizer_fingerprint(endpoint)
    if endpoint_fp and facts.tokenizer_fingerprint != endpoint_fp:
        raise ValidationError(
            {
                "target_path": [
                    f"the tokenizer in target_path (fingerprint {facts.tokenizer_fingerprint[:12]}) does not match "
                    f"the endpoint's ({endpoint_fp[:12]}): target_path must hold the endpoint's own model"
                ]
            }
        )
    policy.target_path = str(facts.directory)
    problem = target_identity.check(endpoint=endpoint, target_path=policy.target_path).problem if identity else ""
    if problem:
        raise ValidationError({"target_path": [problem]})


def validate_policy(*, policy: SpeculationPolicy, endpoint: Endpoint, changed: Collection[str] | None = None) -> None:
    """Raise ValidationError (keyed by field) saying why this policy cannot be applied. changed: the fields this
    save changes (None: any); an off policy's target_path is checked against the served model only when it
    changes, so that turning a policy off never waits on the endpoint."""
    errors: dict[str, list[str]] = {}
    if not K_MIN <= int(policy.k) <= K_MAX:
        errors.setdefault("k", []).append(f"k must be between {K_MIN} and {K_MAX}")
    rate = policy.shadow_sample_rate
    if rate is None or not 0.0 <= float(rate) <= 1.0:
        errors.setdefault("shadow_sample_rate", []).append("shadow_sample_rate must be between 0 and 1")
    if policy.mode not in Mode.values:
        errors.setdefault("mode", []).append(f"unknown mode {policy.mode!r}")
    if policy.mechanism not in Mechanism.values:
        errors.setdefault("mechanism", []).append(f"unknown mechanism {policy.mechanism!r}")
    if policy.path not in VerificationPath.values:
        errors.setdefault("path", []).append(f"unknown path {policy.path!r}")
    errors.update(_check_tree(policy))
    if errors:
        raise ValidationError(errors)
    if policy.target_path:
        identity = policy.mode != Mode.OFF or changed is None or "target_path" in changed
        _check_target_path(policy, endpoint, identity=identity)
    if policy.mode == Mode.OFF:
        return
    if policy.mode == Mode.PROD and endpoint.status != EndpointStatus.READY:
        why = f": {endpoint.status_reason}" if endpoint.status_reason else ""
        errors["mode"] = [f"prod needs a ready endpoint; {endpoint.name} is {endpoint.status}{why}"]
    draft_errors = _check_draft(policy, endpoint)
    if draft_errors:
        errors["draft"] = draft_errors
    if policy.mode == Mode.PROD:
        path_errors = _check_path(policy, endpoint)
        if path_errors:
            errors["path"] = path_errors
    if errors:
        raise ValidationError(errors)


def _plain(value: Any) -> Any:
    if isinstance(value, DraftModel):
        return value.name
    return value


def update_policy(
    *, endpoint: Endpoint, user: AbstractBaseUser | None = None, note: dict[str, Any] | None = None, **fields: Any
) -> SpeculationPolicy:
    """Change the endpoint's policy (only the given fields), validated as a whole; record who changed what.

    `draft` is a DraftModel, its name, or None. Nothing is saved when the result would be invalid. `note`: extra
    entries for the recorded change when something changed (auto-pairing's {"auto": [None, evidence]}), also
    when a managed endpoint's switch records it.
    """
    unknown = sorted(set(fields) - set(EDITABLE_FIELDS))
    if unknown:
        raise ValidationError({name: ["not a policy field"] for name in unknown})
    if "draft" in fields and isinstance(fields["draft"], str):
        name = fields["draft"]
        try:
            fields["draft"] = DraftModel.objects.get(name=name)
        except DraftModel.DoesNotExist as exc:
            raise ValidationError({"draft": [f"no draft named {name!r}"]}) from exc
    with transaction.atomic():
        policy = get_policy(endpoint=endpoint)
        policy = SpeculationPolicy.objects.select_for_update(of=("self",)).select_related("draft").get(pk=policy.pk)
        changes: dict[str, list[Any]] = {}
        if not drafting.drafts_trees(fields.get("mechanism", policy.mechanism)) and "eagle_tree" not in fields:
            fields["eagle_tree"] = {}  # leaving the EAGLE head leaves its tree (recorded with the change)
        for name, value in fields.items():
            old = getattr(policy, name)
            if old != value:
                changes[name] = [_plain(old), _plain(value)]
                setattr(policy, name, value)
        if not changes:
            return policy
        # A switch would start a server that cannot run the mechanism (suffix decoding, the hybrid): refused now.
        known = drafting.MECHANISMS.get(policy.mechanism)  # an unknown one is refused by validation
        served = known is not None and bool(managed_services.speculation_of(policy))  # the server runs it
        problem = known.path_problem(VerificationPath.NATIVE, managed=lambda: True) if served else None
        if problem and _managed(endpoint):
            raise ValidationError({"path": [problem]})
        if managed_services.needs_switch(endpoint=endpoint, policy=policy):
            # A managed endpoint whose server must run differently: applied blue/green once the new instance
            # serves (fleet.managed); until then the saved policy stays as it is.
            managed_services.request_switch(
                endpoint=endpoint,
                policy=policy,
                changes={**changes, **(note or {})},  # recorded with the switch's outcome
                user=user,
                validate=validate_policy,
                editable=EDITABLE_FIELDS,
            )
            policy.refresh_from_db()
            return policy
        validate_policy(policy=policy, endpoint=endpoint, changed=changes.keys())
        _resolve_on_save(policy, endpoint, changes)
        actor = user if user is not None and user.is_authenticated else None
        policy.updated_by = actor
        policy.save()
        PolicyChange.objects.create(policy=policy, changed_by=actor, changes={**changes, **(note or {})})
    logger.info("policy of %s changed by %s: %s", endpoint.name, actor or "system", changes)
    return policy
