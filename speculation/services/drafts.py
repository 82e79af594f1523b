"""Draft registry: register a draft artifact from a local directory (or an n-gram draft, which has none)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from fleet import permissions
from speculation import drafting
from speculation.drafting.mechanisms import HEAD_WEIGHTS, MODEL_WEIGHTS
from speculation.engine.eagle_format import eagle3_problems, is_eagle3_config, is_head_config
from speculation.models import REGISTRABLE_KINDS, DraftKind, DraftModel
from speculation.services.model_files import inspect_model_dir

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, Group

logger = logging.getLogger(__name__)

HYBRID_IS_A_MECHANISM = (
    "suffix_draft is a policy's mechanism, not a kind of draft: register the draft model (kind draft_model) and set "
    "the endpoint's policy to mechanism suffix_draft with it"
)
# The section of config.json that makes a folder one of ACE's EAGLE heads (speculation.engine.eagle_format).
EAGLE_CONFIG_KEY = "ace_eagle"
# Weights plus activations and a short KV cache: a deliberately simple estimate, stated as such in the API.
VRAM_OVERHEAD = 1.2


def inspect_draft_dir(path: str, *, kind: str = DraftKind.DRAFT_MODEL) -> dict[str, Any]:
    """What a draft directory holds: vocab size, parameter count, VRAM estimate, tokenizer fingerprint.

    The directory must lie under the model roots; every malformed file is a ValidationError on `path`
    naming the file and the problem (speculation.services.model_files).
    """
    weights = drafting.for_kind(kind).weights
    facts = inspect_model_dir(path, field="path", llama=weights == MODEL_WEIGHTS)
    config = facts.config
    _check_kind(facts.directory, config, weights)
    return {
        "path": str(facts.directory),
        "vocab_size": config.get("vocab_size"),
        "param_count": facts.param_count,
        "vram_bytes": int(facts.weight_bytes * VRAM_OVERHEAD),
        "tokenizer_fingerprint": facts.tokenizer_fingerprint,
        "config": {key: config.get(key) for key in ("model_type", "hidden_size", "num_hidden_layers", "torch_dtype")},
    }


def _check_kind(directory, config: dict[str, Any], weights: str) -> None:
    """The kind's weights must be what the folder holds: an EAGLE head's config.json carries ACE's `ace_eagle`
    section or is an EAGLE-3 head's (one trained elsewhere: speculation.engine.eagle_format), a draft model's is
    neither. A mismatch would fall back on every prod request; an EAGLE-3 head ACE's engine cannot replay is
    refused."""
    is_head = is_head_config(config)
    if weights == HEAD_WEIGHTS and not is_head:
        raise ValidationError(
            {
                "path": [
                    f"{directory} holds a plain model, not an EAGLE head (its config.json has no {EAGLE_CONFIG_KEY} "
                    f"section and is not an EAGLE-3 head's): register it as kind {DraftKind.DRAFT_MODEL}"
                ]
            }
        )
    problems = eagle3_problems(config) if is_head and is_eagle3_config(config) else []
    if problems:
        raise ValidationError({"path": [f"{directory}: an EAGLE-3 head with {'; '.join(problems)}: ACE runs "
                                        "Llama-layout EAGLE-3 heads only"]})  # fmt: skip
    if weights == MODEL_WEIGHTS and is_head:
        raise ValidationError(
            {
                "path": [
                    f"{directory} holds an EAGLE head, which drafts from a target's hidden states: register it as "
                    f"kind {DraftKind.EAGLE_HEAD}"
                ]
            }
        )


def _name_taken(name: str) -> ValidationError:
    return ValidationError({"name": [f"a draft named {name!r} already exists (names are unique in any letter case)"]})


def _check_name_free(name: str) -> None:
    taken = DraftModel.objects.filter(name__iexact=name).values_list("name", flat=True).first()
    if taken is not None:
        raise _name_taken(taken)


def register_draft(
    *,
    name: str,
    kind: str,
    path: str = "",
    node_class: str = "cpu",
    target_name: str = "",
    owner: AbstractBaseUser | None = None,
    team: Group | None = None,
) -> DraftModel:
    """Register a draft; its facts are read from the directory, never taken from the caller.

    `owner` and `team` decide who sees and deletes it (fleet.permissions); neither: admins only.
    """
    mechanism = drafting.MECHANISMS.get(kind)
    if mechanism is None:
        known = ", ".join(value for value, _ in REGISTRABLE_KINDS)
        raise ValidationError({"kind": [f"unknown kind {kind!r}: choose one of {known}"]})
    if not mechanism.registrable:
        raise ValidationError({"kind": [HYBRID_IS_A_MECHANISM]})
    facts: dict[str, Any] = {}
    if not mechanism.weights:
        if path:
            raise ValidationError({"path": [f"a {kind} draft has no weights: leave path empty"]})
    else:
        if not path:
            raise ValidationError({"path": [f"a {kind} needs the directory of its weights"]})
        facts = inspect_draft_dir(path, kind=kind)
        path = facts.pop("path")
    _check_name_free(name)
    owner = owner if owner is not None and owner.is_authenticated else None
    draft = DraftModel(
        name=name, kind=kind, path=path, node_class=node_class, target_name=target_name, owner=owner, team=team, **facts
    )
    draft.full_clean()
    try:
        with transaction.atomic():
            draft.save()
    except IntegrityError as exc:  # registered meanwhile
        raise _name_taken(name) from exc
    logger.info("draft %s registered (%s, %s params)", name, kind, facts.get("param_count"))
    return draft


def delete_draft(*, draft: DraftModel, user: AbstractBaseUser | None = None) -> None:
    """Delete a draft no policy uses. The refusal names only the endpoints `user` may see (None: every one)."""
    endpoints = [p.endpoint for p in draft.speculationpolicy_set.select_related("endpoint")]
    if endpoints:
        named = [e.name for e in endpoints if user is None or permissions.can_see(user, e)]
        hidden = len(endpoints) - len(named)
        users = [", ".join(named)] if named else []
        if hidden:
            users.append(f"{hidden} endpoint{'s' if hidden > 1 else ''} you cannot see")
        raise ValidationError({"draft": [f"draft {draft.name!r} is in use by the policy of {' and '.join(users)}"]})
    draft.delete()
