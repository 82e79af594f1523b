"""Which policy options an endpoint can take right now, and why not: the pages grey an option out and say why.

No rules of its own: each option is tried on an unsaved copy of the policy through the policy service's
validation (`speculation.services.policies.validate_policy`), so the page and the API refuse for the same
reasons, worded the same way.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError

from fleet.models import Endpoint
from speculation import drafting
from speculation.models import DraftModel, Mechanism, Mode, SpeculationPolicy, VerificationPath
from speculation.selectors import capabilities
from speculation.services.policies import resolve_path, validate_policy


@dataclass(frozen=True)
class Option:
    value: str
    label: str
    available: bool
    reason: str = ""
    current: bool = False


def _reasons(policy: SpeculationPolicy, endpoint: Endpoint, **changes: Any) -> str:
    trial = copy.copy(policy)
    for name, value in changes.items():
        setattr(trial, name, value)
    try:
        validate_policy(policy=trial, endpoint=endpoint)
    except ValidationError as exc:
        messages = exc.message_dict if hasattr(exc, "error_dict") else {"": exc.messages}
        return "; ".join(msg for msgs in messages.values() for msg in msgs)
    return ""


def mode_options(*, policy: SpeculationPolicy, endpoint: Endpoint) -> list[Option]:
    """off / shadow / prod, each with why it cannot be switched to (with the rest of the policy as it is)."""
    options = []
    for mode in Mode:
        reason = "" if mode == Mode.OFF else _reasons(policy, endpoint, mode=mode.value)
        options.append(Option(mode.value, mode.label, not reason, reason, current=policy.mode == mode.value))
    return options


def draft_options(*, policy: SpeculationPolicy, endpoint: Endpoint, drafts: list[DraftModel]) -> list[Option]:
    """Registered drafts, each tried with its own mechanism in the policy's mode (prod if the policy is off,
    since prod is the strictest use)."""
    mode = policy.mode if policy.mode != Mode.OFF else Mode.PROD
    options = []
    for draft in drafts:
        mechanism = draft.kind if draft.kind in Mechanism.values else Mechanism.DRAFT_MODEL
        reason = _reasons(policy, endpoint, mode=mode, draft=draft, mechanism=mechanism)
        options.append(Option(draft.name, draft.name, not reason, reason, current=policy.draft_id == draft.pk))
    return options


def path_options(*, policy: SpeculationPolicy, endpoint: Endpoint) -> list[Option]:
    """Verification paths for prod, each with why it does not fit this endpoint."""
    options = []
    for path in VerificationPath:
        reason = _reasons(policy, endpoint, mode=Mode.PROD, path=path.value)
        options.append(Option(path.value, path.label, not reason, reason, current=policy.path == path.value))
    return options


def draft_compatible(*, draft: DraftModel, endpoint: Endpoint) -> tuple[bool, str]:
    """Tokenizer-fingerprint compatibility of one draft with one endpoint (lookup drafts always fit)."""
    if drafting.for_kind(draft.kind).looks_up:
        return True, f"{draft.get_kind_display()} uses the endpoint's own tokens"
    endpoint_fp = capabilities.tokenizer_fingerprint(endpoint)
    if not endpoint_fp:
        return False, "endpoint not probed yet (no tokenizer fingerprint)"
    if not draft.tokenizer_fingerprint:
        return False, "draft has no tokenizer fingerprint"
    if draft.tokenizer_fingerprint != endpoint_fp:
        return False, f"tokenizer differs ({draft.tokenizer_fingerprint[:8]} vs {endpoint_fp[:8]})"
    return True, f"same tokenizer ({endpoint_fp[:8]})"


def effective_path(*, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """The verification path prod would use now ("" when none fits)."""
    return resolve_path(policy=policy, endpoint=endpoint)
