"""Speculation policy per endpoint: read, validate, change (every change kept with who and when)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import transaction

from fleet.models import Endpoint, EndpointStatus
from speculation.models import (
    DraftKind,
    DraftModel,
    Mechanism,
    Mode,
    PolicyChange,
    SpeculationPolicy,
    VerificationPath,
)
from speculation.limits import K_MAX, K_MIN
from speculation.services import capabilities

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser

logger = logging.getLogger(__name__)

EDITABLE_FIELDS = ("mode", "mechanism", "draft", "k", "dynamic_k", "shadow_sample_rate", "path", "target_path")


def get_policy(*, endpoint: Endpoint) -> SpeculationPolicy:
    """The endpoint's policy; an endpoint that never had one is off (the default is created on first read)."""
    policy, _ = SpeculationPolicy.objects.get_or_create(endpoint=endpoint)
    return policy


def resolve_path(*, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """The verification path prod uses: the override, or from the probe (native > remote). "" if none fits."""
    if policy.path != VerificationPath.AUTO:
        return policy.path
    if capabilities.native_speculation(endpoint):
        return VerificationPath.NATIVE
    if capabilities.can_score_token_prompts(endpoint):
        return VerificationPath.REMOTE
    if policy.target_path:
        return VerificationPath.LOCAL
    return ""


def _check_draft(policy: SpeculationPolicy, endpoint: Endpoint) -> list[str]:
    """Why the draft cannot serve this endpoint (empty when it can)."""
    if policy.mechanism == Mechanism.NGRAM:
        if policy.draft is not None and policy.draft.kind != DraftKind.NGRAM:
            return [f"mechanism ngram takes no draft weights, but draft {policy.draft.name!r} is a {policy.draft.kind}"]
        return []
    draft = policy.draft
    if draft is None:
        return [f"mechanism {policy.mechanism} needs a registered draft"]
    if draft.kind != policy.mechanism:
        return [f"draft {draft.name!r} is a {draft.kind}, not a {policy.mechanism}"]
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
    path = resolve_path(policy=policy, endpoint=endpoint)
    if not path:
        return [
            "no verification path fits this endpoint: it neither speculates itself nor scores token-id "
            "prompts (probe it, or set path=local with a target_path)"
        ]
    if path == VerificationPath.NATIVE and not capabilities.native_speculation(endpoint):
        return ["path native needs a server that speculates itself (the probe found no speculative decoding)"]
    if path == VerificationPath.REMOTE and not capabilities.can_score_token_prompts(endpoint):
        return ["path remote needs an endpoint that scores token-id prompts (prompt_logprobs); the probe found none"]
    if path == VerificationPath.LOCAL:
        if not policy.target_path:
            return ["path local needs target_path: the target's model directory on the node class"]
        if not (Path(policy.target_path) / "config.json").is_file():
            return [f"target_path {policy.target_path!r} holds no config.json"]
    if policy.mechanism == Mechanism.EAGLE_HEAD and path != VerificationPath.LOCAL:
        return ["an EAGLE head reads the target's hidden states: it needs path local"]
    return []


def validate_policy(*, policy: SpeculationPolicy, endpoint: Endpoint) -> None:
    """Raise ValidationError (keyed by field) saying why this policy cannot be applied."""
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
    if errors:
        raise ValidationError(errors)
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


def update_policy(*, endpoint: Endpoint, user: AbstractBaseUser | None = None, **fields: Any) -> SpeculationPolicy:
    """Change the endpoint's policy (only the given fields), validated as a whole; record who changed what.

    `draft` is a DraftModel, its name, or None. Nothing is saved when the result would be invalid.
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
        for name, value in fields.items():
            old = getattr(policy, name)
            if old != value:
                changes[name] = [_plain(old), _plain(value)]
                setattr(policy, name, value)
        if not changes:
            return policy
        validate_policy(policy=policy, endpoint=endpoint)
        actor = user if user is not None and user.is_authenticated else None
        policy.updated_by = actor
        policy.save()
        PolicyChange.objects.create(policy=policy, changed_by=actor, changes=changes)
    logger.info("policy of %s changed by %s: %s", endpoint.name, actor or "system", changes)
    return policy
