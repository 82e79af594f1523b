"""Proposers: whatever guesses the next K tokens, behind one small protocol (the loop never asks which).

A proposer sees the committed token ids, proposes up to k tokens, then learns how many were accepted.
``observe_target`` hands it the target's features of the last verification (EAGLE heads need them);
proposers that do not need them ignore it (``wants_hidden = False`` keeps the target from computing them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from speculation.engine.model import Transformer
from speculation.engine.sampling import SamplingParams, probs_from_logits, sample
from speculation.engine.tree import DraftTree
from speculation.engine.vocab import draft_width, widen


@dataclass
class Proposal:
    tokens: Tensor  # [k'] long, k' <= k (may be empty)
    q: Tensor | None  # [k', V] the draft's processed distribution; None = one-hot drafts
    tree: DraftTree | None = None  # a draft tree (tokens are its nodes): verified by engine/tree.py
    looked_up: bool = False  # drafts from a lookup, not a model (a hybrid's step that cost no model step)


@runtime_checkable
class Proposer(Protocol):
    wants_hidden: bool | tuple[int, ...]  # the target features it reads (engine.model.HiddenRequest)

    def begin(self, prompt_ids: list[int]) -> None:
        """A new request starts with these prompt tokens."""

    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Propose up to k tokens to follow ``committed``."""

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        """The last proposal had num_accepted of num_drafted tokens accepted (roll back the rest)."""

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        """The target's features [K+1, D] of the last verification (only called when wants_hidden)."""


class LookupProposer:
    """A proposer that looks its drafts up (no model, one-hot drafts, no state per request): subclasses give
    ``lookup(committed, k)``, which the batch loop also calls directly for each slot, and ``batch_key``, which
    requests may share one batch under (equal keys: the same lookup)."""

    wants_hidden = False
    device = torch.device("cpu")

    @property
    def batch_key(self) -> tuple:
        raise NotImplementedError

    def lookup(self, committed: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(tokens=torch.tensor(self.lookup(committed, k), dtype=torch.long, device=self.device), q=None)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        pass

    def batch_form(self) -> BatchForm:
        return BatchForm(lookup=self)


class NgramProposer(LookupProposer):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and copy what followed."""

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    @property
    def batch_key(self) -> tuple:
        return ("ngram", self.max_ngram, self.min_ngram)

    def lookup(self, committed: list[int], k: int) -> list[int]:
        n_tokens = len(committed)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            suffix = committed[n_tokens - n :]
            for start in range(n_tokens - n - 1, -1, -1):  # latest match first
                if committed[start : start + n] == suffix:
                    return committed[start + n : start + n + k]
        return []


def draft_chain(
    logits: Tensor,
    forward: Callable[[Tensor, int], Tensor],
    ks: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    *,
    width: int,
    vocab_size: int,
) -> tuple[Tensor, list[Tensor | None]]:
    """A draft model's chain over rows, written once for one request and for the batch engine's rows.

    logits [B, V'] is the draft's next-token logits over the ids both vocabularies share (``width``);
    ``forward(tokens [B], j)`` feeds draft j of every row and returns the next logits [B, V']. Row b takes the
    argmax (greedy) or draws from q, its processed distribution widened to ``vocab_size``, with its own generator,
    for its first ks[b] steps only, so its draws do not depend on its neighbours. The last draft is never fed.
    Returns the drafts [B, max(ks)] (row b's first ks[b] are its own) and each row's q [ks[b], V] (None: greedy).
    """
    k_max = max(ks)
    columns: list[Tensor] = []
    qs: list[list[Tensor]] = [[] for _ in ks]
    for j in range(k_max):
        token = logits.argmax(-1)  # [B]
        for b, (k, row_params, generator) in enumerate(zip(ks, params, generators, strict=True)):
            if not row_params.greedy and j < k:
                q = probs_from_logits(widen(logits[b], width, vocab_size), row_params)  # [V]
                token[b] = sample(q, generator)
                qs[b].append(q)
        columns.append(token)
        if j + 1 < k_max:
            logits = forward(token, j)  # [B, V']
    return torch.stack(columns, dim=1), [torch.stack(q) if q else None for q in qs]


class DraftModelProposer:
    """A small causal LM with the target's tokenizer and its own KV cache.

    The draft's cache holds ``cached`` committed positions; a proposal feeds the committed tokens it has not
    seen (one or two) and then its own drafts (``draft_chain``, as a batch of one). After verification the accepted
    drafts stay cached (they are the committed tokens at those positions), the rest is rolled back. A draft whose
    checkpoint pads the vocabulary to another size than the target's drafts among the tokenizer's ``shared_vocab``
    ids (engine/vocab.py).
    """

    wants_hidden = False

    def __init__(self, model: Transformer, *, target_vocab_size: int, shared_vocab: int | None = None):
        self.width = draft_width(model.vocab_size, target_vocab_size, shared_vocab)  # VocabMismatchError
        self.target_vocab_size = target_vocab_size
        self.model = model
        self.device = model.output.weight.device
        self.cached = 0
        self._proposed_from = 0

    def begin(self, prompt_ids: list[int]) -> None:
        self.cached = 0

    @torch.inference_mode()
    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        n_committed = self._proposed_from = len(committed)
        k = min(k, self.model.max_len - n_committed)
        if k <= 0:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=self.device), q=None)
        # a target's padding id past the draft's vocabulary (never text) is read as its last id
        feed = torch.tensor(committed[self.cached :], device=self.device).clamp_max(self.model.vocab_size - 1)
        logits = self.model(feed, self.cached).logits[-1:, : self.width]  # [1, V'] the ids both vocabularies share
        self.cached = n_committed  # positions beyond are the drafts' (kept only if accepted)

        def forward(token: Tensor, j: int) -> Tensor:  # draft j, at position n_committed + j
            return self.model(token, n_committed + j).logits[-1:, : self.width]

        drafted, qs = draft_chain(
            logits, forward, [k], [params], [generator], width=self.width, vocab_size=self.target_vocab_size
        )
        return Proposal(tokens=drafted[0], q=qs[0])

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        # drafts 1..k-1 were fed to the draft (the last one never is); accepted ones stay valid
        self.cached = self._proposed_from + min(num_accepted, max(num_drafted - 1, 0))

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        pass

    def batch_form(self) -> BatchForm | None:
        """Its model over the batch engine's rows: ACE's own layer only (a model transformers runs: batch one)."""
        if getattr(self.model, "implementation", "native") != "native":
            return None
        return BatchForm(draft=self.model, width=self.width)


HYBRID_LOOKUP_K = 8  # how far a hybrid's lookup may draft (its own cut stops it earlier): the engine's K for it
HYBRID_MIN_LOOKUP = 3  # a lookup draft this long is verified instead of the model's (measured: docs/BENCHMARKS.md)


def hybrid_lookup(lookup: LookupProposer, committed: list[int], k: int, min_lookup: int) -> list[int] | None:
    """A hybrid's rule, for one request and for the batch engine's slots: the lookup's draft (up to k tokens) where it
    finds at least min_lookup tokens, else None (the draft model drafts this step)."""
    if k < min_lookup:  # the lookup could not find enough
        return None
    found = lookup.lookup(committed, k)
    return found if len(found) >= min_lookup else None


class HybridProposer:
    """A lookup first, a model where the lookup finds too little (SuffixDecoding's hybrid with a model drafter).

    Each step asks the lookup (suffix decoding over the endpoint's earlier answers) for up to k drafts; a draft of
    at least ``min_lookup`` tokens is verified as it is (one-hot, no model step: ``Proposal.looked_up``), else the
    fallback (a draft model) drafts at most ``model_k``. The engine's K for a hybrid is the lookup's cap
    (HYBRID_LOOKUP_K, within the request's budget); ``model_k`` is the policy's K. The fallback skips the steps
    the lookup served: a draft model's cache keeps the committed positions it saw and feeds the rest on its next
    step. Exact for greedy and sampled requests (each step is verified as its own drafter's).
    """

    def __init__(
        self, lookup: LookupProposer, fallback: Proposer, *, model_k: int, min_lookup: int = HYBRID_MIN_LOOKUP
    ):
        if model_k < 1 or min_lookup < 1:
            raise ValueError("model_k and min_lookup must be >= 1")
        self.lookup, self.fallback = lookup, fallback
        self.model_k, self.min_lookup = model_k, min_lookup
        self.wants_hidden = fallback.wants_hidden
        self._fell_back = False

    def begin(self, prompt_ids: list[int]) -> None:
        self.fallback.begin(prompt_ids)
        self._fell_back = False

    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        drafts = hybrid_lookup(self.lookup, committed, k, self.min_lookup)
        self._fell_back = drafts is None
        if drafts is not None:
            return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), q=None, looked_up=True)
        return self.fallback.propose(committed, min(k, self.model_k), params, generator)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        if self._fell_back:
            self.fallback.on_verified(num_accepted, num_drafted)

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        if self._fell_back:
            self.fallback.observe_target(hidden, num_accepted)

    def batch_form(self) -> BatchForm | None:
        """The lookup and the fallback's draft model (a fallback that is not a draft model: batch one)."""
        model = batch_form(self.fallback)
        lookup = batch_form(self.lookup)
        if model is None or model.draft is None or lookup is None or lookup.lookup is None:
            return None
        return BatchForm(draft=model.draft, width=model.width, lookup=lookup.lookup)


@dataclass(frozen=True)
class BatchForm:
    """A proposer's batch form: what the batch engine (engine/batch.py) drafts with for many requests at once in
    its place: a draft model (its weights, run over the engine's own rows; width: the ids it drafts among), a lookup,
    or both (a hybrid)."""

    draft: Transformer | None = None
    width: int | None = None
    lookup: LookupProposer | None = None


def batch_form(proposer: object) -> BatchForm | None:
    """The proposer's batch form; None where the batch engine cannot draft for it (an EAGLE head, plain decoding, a
    model transformers runs, a hybrid over another fallback), which is then served at batch one."""
    form = getattr(proposer, "batch_form", None)
    return form() if form is not None else None


def loop_k(proposer: object, k: int) -> int:
    """The single-stream loop's K for a policy's K: a hybrid drafts with the policy's K (its model_k) where the model
    drafts, and its lookups up to HYBRID_LOOKUP_K, the loop's K; any other proposer drafts the policy's K."""
    if k > 0 and isinstance(proposer, HybridProposer):
        proposer.model_k = k
        return max(k, HYBRID_LOOKUP_K)
    return k
