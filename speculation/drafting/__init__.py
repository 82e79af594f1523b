"""The draft mechanisms, one class each (speculation.drafting.mechanisms): callers look a mechanism up by its kind
(a policy's mechanism, a candidate's or a draft's kind) instead of comparing kinds."""

from __future__ import annotations

from speculation.drafting.mechanisms import (
    Drafting,
    DraftModelDrafting,
    EagleDrafting,
    HybridDrafting,
    NgramDrafting,
    SuffixDrafting,
)

MECHANISMS: dict[str, Drafting] = {
    m.kind: m for m in (NgramDrafting(), SuffixDrafting(), DraftModelDrafting(), HybridDrafting(), EagleDrafting())
}
BATCHED_KINDS = frozenset(kind for kind, m in MECHANISMS.items() if m.batches)


def for_kind(kind: str) -> Drafting:
    """The mechanism of this kind; ValueError naming the known ones for any other."""
    try:
        return MECHANISMS[kind]
    except KeyError:
        raise ValueError(f"unknown draft mechanism {kind!r}: choose one of {', '.join(MECHANISMS)}") from None


def drafts_trees(kind: str) -> bool:
    """Whether a mechanism of this kind drafts the policy's EAGLE-2 tree (False for an unknown kind)."""
    mechanism = MECHANISMS.get(kind)
    return mechanism is not None and mechanism.drafts_trees
