"""Draft registry: register a draft artifact from a local directory (or an n-gram draft, which has none)."""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from speculation.models import LOOKUP_KINDS, REGISTRABLE_KINDS, DraftKind, DraftModel
from speculation.services.model_files import inspect_model_dir

logger = logging.getLogger(__name__)

HYBRID_IS_A_MECHANISM = (
    "suffix_draft is a policy's mechanism, not a kind of draft: register the draft model (kind draft_model) and set "
    "the endpoint's policy to mechanism suffix_draft with it"
)
# Weights plus activations and a short KV cache: a deliberately simple estimate, stated as such in the API.
VRAM_OVERHEAD = 1.2


def inspect_draft_dir(path: str, *, kind: str = DraftKind.DRAFT_MODEL) -> dict[str, Any]:
    """What a draft directory holds: vocab size, parameter count, VRAM estimate, tokenizer fingerprint.

    The directory must lie under the model roots; every malformed file is a ValidationError on `path`
    naming the file and the problem (speculation.services.model_files).
    """
    facts = inspect_model_dir(path, field="path", llama=kind == DraftKind.DRAFT_MODEL)
    config = facts.config
    return {
        "path": str(facts.directory),
        "vocab_size": config.get("vocab_size"),
        "param_count": facts.param_count,
        "vram_bytes": int(facts.weight_bytes * VRAM_OVERHEAD),
        "tokenizer_fingerprint": facts.tokenizer_fingerprint,
        "config": {key: config.get(key) for key in ("model_type", "hidden_size", "num_hidden_layers", "torch_dtype")},
    }


def register_draft(
    *, name: str, kind: str, path: str = "", node_class: str = "cpu", target_name: str = ""
) -> DraftModel:
    """Register a draft; its facts are read from the directory, never taken from the caller."""
    if kind == DraftKind.SUFFIX_DRAFT:
        raise ValidationError({"kind": [HYBRID_IS_A_MECHANISM]})
    if kind not in DraftKind.values:
        known = ", ".join(value for value, _ in REGISTRABLE_KINDS)
        raise ValidationError({"kind": [f"unknown kind {kind!r}: choose one of {known}"]})
    facts: dict[str, Any] = {}
    if kind in LOOKUP_KINDS:
        if path:
            raise ValidationError({"path": [f"a {kind} draft has no weights: leave path empty"]})
    else:
        if not path:
            raise ValidationError({"path": [f"a {kind} needs the directory of its weights"]})
        facts = inspect_draft_dir(path, kind=kind)
        path = facts.pop("path")
    draft = DraftModel(name=name, kind=kind, path=path, node_class=node_class, target_name=target_name, **facts)
    try:
        draft.full_clean()
    except ValidationError:
        raise
    try:
        with transaction.atomic():
            draft.save()
    except IntegrityError as exc:
        raise ValidationError({"name": [f"a draft named {name!r} already exists"]}) from exc
    logger.info("draft %s registered (%s, %s params)", name, kind, facts.get("param_count"))
    return draft


def delete_draft(*, draft: DraftModel) -> None:
    if draft.speculationpolicy_set.exists():
        names = ", ".join(p.endpoint.name for p in draft.speculationpolicy_set.select_related("endpoint"))
        raise ValidationError({"draft": [f"draft {draft.name!r} is used by the policy of {names}"]})
    draft.delete()
