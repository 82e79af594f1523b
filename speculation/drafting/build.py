"""The proposers and replays the draft mechanisms (speculation.drafting.mechanisms) build: prod's proposer with the
tokenizer and end tokens a request uses, the greedy replay of a known sequence at each K (shadow and the candidate
replays), and the proposer a draft step is timed with. All through the engine's proposers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from speculation.engine import (
    HYBRID_LOOKUP_K,
    DraftModelProposer,
    HybridProposer,
    NgramProposer,
    SpecStats,
    SuffixProposer,
)
from speculation.engine.eagle import EagleProposer
from speculation.engine.proposers import LookupProposer
from speculation.engine.replay import (
    draft_greedy_predictions,
    replay_greedy,
    replay_proposals,
    replay_proposer,
    teacher_forced,
)
from speculation.engine.tree import TreeShape
from speculation.worker import suffix_store
from speculation.worker.paths import resources
from speculation.worker.paths.text import eos_token_ids


class PathUnavailable(RuntimeError):
    """The policy's path cannot run here (missing tokenizer, target, draft)."""


@dataclass(frozen=True)
class DraftSetup:
    proposer: Any
    tokenizer: Any
    eos_ids: frozenset[int]
    vocab_size: int


# --- prod: the proposer a request drafts with ---------------------------------------------------------------------


def _text_source(policy: Any) -> str:
    if policy.draft is not None and policy.draft.path:
        return policy.draft.path
    if policy.target_path:
        return policy.target_path
    raise PathUnavailable("no tokenizer in the worker: n-gram drafting needs target_path (the target's model dir)")


def lookup_setup(policy: Any, target: resources.Loaded | None, mechanism: Any) -> DraftSetup:
    """n-gram lookup or suffix decoding (over the endpoint's earlier answers), with the target's tokenizer."""
    source = _text_source(policy)
    tok = resources.tokenizer(source)
    vocab = target.model.vocab_size if target is not None else len(tok)
    proposer = mechanism.endpoint_lookup(policy.endpoint_id)
    return DraftSetup(proposer, tok, eos_token_ids(source, tok), vocab)


def _weights(policy: Any) -> None:
    if policy.draft is None or not policy.draft.path:
        raise PathUnavailable("the policy has no draft weights")


def draft_model_setup(policy: Any, target: resources.Loaded | None) -> DraftSetup:
    """A draft model's proposer; against a local target whose checkpoint pads the vocabulary to another size, it
    drafts among their tokenizer's ids (their tokenizers are one: the policy's fingerprint check)."""
    _weights(policy)
    vocab = target.model.vocab_size if target is not None else 0
    try:
        draft = resources.model(policy.draft.path)
        vocab = vocab or draft.model.vocab_size
        shared = resources.shared_vocab(draft, vocab)
        proposer = DraftModelProposer(draft.model, target_vocab_size=vocab, shared_vocab=shared)
    except Exception as exc:  # noqa: BLE001 - any load failure is a draft error the gateway falls back from
        raise PathUnavailable(f"draft error: cannot load {policy.draft.name}: {type(exc).__name__}: {exc}") from exc
    return DraftSetup(proposer, draft.tokenizer, draft.eos_ids, vocab)


def hybrid_setup(policy: Any, target: resources.Loaded | None, mechanism: Any) -> DraftSetup:
    """Suffix decoding first, the draft model where it finds little."""
    model = draft_model_setup(policy, target)
    lookup = mechanism.endpoint_lookup(policy.endpoint_id)
    return replace(model, proposer=HybridProposer(lookup, model.proposer, model_k=max(1, policy.k)))


def eagle_setup(policy: Any, target: resources.Loaded | None) -> DraftSetup:
    """The policy's EAGLE head over the local target: its EAGLE-2 draft tree (K caps its depth), {} a chain of K."""
    _weights(policy)
    if target is None:
        raise PathUnavailable("an EAGLE head reads the target's hidden states: on ACE's engine it needs path local")
    try:
        head = resources.eagle_head(policy.draft.path, target_dir=target.directory)
        proposer = EagleProposer(head, target.model, tree=TreeShape.from_policy(policy.eagle_tree))
    except Exception as exc:  # noqa: BLE001 - as above
        raise PathUnavailable(f"draft error: cannot load {policy.draft.name}: {type(exc).__name__}: {exc}") from exc
    return DraftSetup(proposer, target.tokenizer, target.eos_ids, target.model.vocab_size)


def ngram_lookup() -> NgramProposer:
    return NgramProposer()


def suffix_lookup(index: Any, *, exclude: str = "") -> SuffixProposer:
    return SuffixProposer(index, exclude=exclude)


def endpoint_index(endpoint_id: int) -> Any:
    """The endpoint's store of earlier answers, up to date (speculation.worker.suffix_store)."""
    return suffix_store.index_for(endpoint_id)


# --- greedy replay of a known sequence --------------------------------------------------------------------------


def replay_lookup(
    sequence: list[int], ks: tuple[int, ...], *, common: dict[str, Any], lookup: LookupProposer, **_: Any
) -> dict[int, SpecStats]:
    """A lookup's drafts replayed."""

    def propose(n: int, drafted: int) -> list[int]:
        return lookup.lookup(sequence[:n], drafted)

    return {k: replay_proposals(propose, sequence, k, **common) for k in ks}


def replay_draft_model(
    sequence: list[int], ks: tuple[int, ...], *, draft_path: str, common: dict[str, Any], target_path: str = "",
    **_: Any,
) -> dict[int, SpecStats]:  # fmt: skip
    draft = resources.model(draft_path)
    width = resources.draft_width(draft, target_path)  # as prod drafts against that target
    predictions = draft_greedy_predictions(draft.model, sequence, width=width)  # one pass serves every K
    return {k: replay_greedy(predictions, sequence, k, **common) for k in ks}


def replay_hybrid_at(
    sequence: list[int], ks: tuple[int, ...], *, draft_path: str, common: dict[str, Any], target_path: str = "",
    lookup: LookupProposer | None = None, **_: Any,
) -> dict[int, SpecStats]:  # fmt: skip
    """Suffix decoding with a draft model's fallback at each K (the draft's K; the lookup drafts up to its own cap,
    HYBRID_LOOKUP_K), as prod's HybridProposer runs it: exact for greedy, the draft's drafts from one
    teacher-forced pass (its chain is accepted exactly as far as its teacher-forced predictions match)."""
    lookup = lookup or SuffixProposer()
    draft = resources.model(draft_path)
    width = resources.draft_width(draft, target_path)
    model = teacher_forced(draft_greedy_predictions(draft.model, sequence, width=width))
    return {
        k: replay_proposer(HybridProposer(lookup, model, model_k=k), sequence, max(k, HYBRID_LOOKUP_K), **common)
        for k in ks
    }


@torch.inference_mode()
def replay_eagle_at(
    sequence: list[int], ks: tuple[int, ...], *, draft_path: str, common: dict[str, Any], target_path: str = "",
    tree: TreeShape | None = None, **_: Any,
) -> dict[int, SpecStats]:  # fmt: skip
    """An EAGLE head's greedy speculation at each K: the target's features of the known sequence (the ones the
    head reads: the final-norm feature, or its layers for a multi-layer head) from one teacher-forced pass, handed
    to the head by the replay's ReplayTarget; a tree is verified against the known output (exact, as prod's local
    path drafts and verifies it)."""
    if not target_path:
        raise ValueError("an EAGLE head reads the target's features: the worker needs the target (target_path)")
    target = resources.model(target_path).model
    head = resources.eagle_head(draft_path, target_dir=target_path)
    wants = EagleProposer(head, target).wants_hidden
    hidden = target(torch.tensor(sequence, device=target.output.weight.device), 0, return_hidden=wants).hidden
    return {
        k: replay_proposer(EagleProposer(head, target, tree=tree), sequence, k, hidden=hidden, **common) for k in ks
    }


# --- timing a draft step ----------------------------------------------------------------------------------------


def timed_lookup() -> NgramProposer:
    return NgramProposer()  # the lookup kinds' shared calibration (CostKey)


def timed_draft_model(policy: Any) -> Any:
    if policy.draft is None:
        return timed_lookup()
    model = resources.model(policy.draft.path).model
    return DraftModelProposer(model, target_vocab_size=model.vocab_size)


def timed_eagle(policy: Any) -> Any:
    if policy.draft is None:
        return timed_lookup()
    if not policy.target_path:
        raise PathUnavailable("an EAGLE head drafts from the target's features: it needs the target in the worker")
    target = resources.model(policy.target_path).model
    head = resources.eagle_head(policy.draft.path, target_dir=policy.target_path)
    return FeaturesFed(EagleProposer(head, target), width=target.args.dim)


class FeaturesFed:
    """An EAGLE proposer timed outside the decode loop: after each step it is fed one feature row for the token
    committed next, as the loop's verification would (the values do not change what a draft step costs)."""

    wants_hidden = False

    def __init__(self, inner: Any, *, width: int) -> None:
        self.inner = inner
        self.row = torch.zeros(1, width, device=inner.device)  # [1, D]

    def begin(self, prompt_ids: list[int]) -> None:
        self.inner.begin(prompt_ids)

    def propose(self, committed: list[int], k: int, params: Any, generator: Any) -> Any:
        return self.inner.propose(committed, k, params, generator)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        self.inner.on_verified(num_accepted, num_drafted)
        self.inner.observe_target(self.row, 0)
