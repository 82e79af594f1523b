"""Continuous batching: many requests (slots) speculated together, each exactly as if it ran alone.

One ``step()`` drafts every active slot in one draft forward per draft position and verifies every slot in one
target forward (speculation.engine.batch_model: one KV-cache row per slot, each at its own position). A request
joins with ``add()`` (its prompt is prefilled into a free row; it takes part in the next step) and leaves when
it is done (a stop token, max_new_tokens, the context) or when the caller ``remove()``s it (cancelled, or a
stop string matched); the last row moves into the freed one, so active slots are always rows 0..n-1.

Per slot the rules are decode.generate's: the same draft length limit (step_lookahead), verification
(verify_greedy / verify_sampled of verify.py on the slot's own rows, with its own seeded generator, drawn in
the same order as generate: a slot's draws do not depend on its neighbours), min_tokens suppression and stop
tokens. Greedy slots are therefore token-identical to plain decoding of the request alone; sampled slots are
distributed exactly as the target's processed distribution.

Hybrid (a draft model and a lookup: suffix decoding with the draft's fallback, as proposers.HybridProposer): each
slot asks the lookup first for up to ``lookup_k`` drafts; a draft of at least ``min_lookup`` tokens is verified as
it is (one-hot, no draw), and the draft model drafts for the other slots, its batched forwards over their rows
only (BatchedModel.forward(rows=...)); a slot the lookup served is not fed, and its draft row catches up on its
next model step, as HybridProposer's draft does. A slot's steps are therefore those HybridProposer gives the
request alone, seed for seed. With a LoadAwareLookahead
the lookups' length follows it too (``choose_lookup``: their own acceptance, no draft step, the measured verify
costs), as the draft's K does, for the slots that follow the controller.

Lookahead: with a LoadAwareLookahead, greedy slots draft the K it chooses at the current batch size (K = 0 is
plain batched decoding); their output does not depend on K. Greedy and sampled slots' acceptances are estimated
apart, so each kind gets the K that pays for it. Sampled slots keep their request's K, so that the
same seed gives the same tokens whatever the load, unless their request set no seed (``GenerationConfig.fixed_k``
False): then they draft the controller's K too (rejection sampling is exact at any K; only which draws make the
tokens changes, and nobody asked for them again).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from speculation.engine.batch_model import BatchedModel
from speculation.engine.lookahead import Lookahead, StepReport
from speculation.engine.model import Transformer
from speculation.engine.prefix_cache import PrefixCache
from speculation.engine.proposers import (
    HYBRID_LOOKUP_K,
    HYBRID_MIN_LOOKUP,
    LookupProposer,
    Proposer,
    draft_chain,
    hybrid_lookup,
)
from speculation.engine.request import (
    EndsAfter,
    GenerationConfig,
    check_request,
    step_lookahead,
    stop_check,
    truncate_at_stop,
)
from speculation.engine.sampling import SamplingParams, probs_from_logits, suppress_before_min_tokens
from speculation.engine.stats import SpecStats
from speculation.engine.target import Target, TargetRow
from speculation.engine.tree import DraftTree, verify_tree_step
from speculation.engine.verify import verify_greedy, verify_sampled
from speculation.engine.vocab import draft_width


class BatchFullError(RuntimeError):
    """Every slot is taken: the caller keeps the request until one frees."""


@dataclass(frozen=True)
class SlotUpdate:
    """What one step did for one slot."""

    key: Hashable
    tokens: list[int]  # committed: the accepted drafts + the target's token, cut after a stop token
    drafted: int
    accepted: int  # accepted drafts that were emitted
    looked_up: bool = False  # a hybrid's lookup drafted this step (no draft-model step)
    finish_reason: str | None = None  # "stop" | "length": the slot left the batch after this step
    stats: SpecStats | None = None  # the slot's whole run, with its last update


@dataclass
class _Slot:
    key: Hashable
    config: GenerationConfig
    params: SamplingParams
    committed: list[int]
    max_context: int
    generator: torch.Generator
    is_stop: Callable[[int], bool]  # does the request end after this token (a stop token, the caller's rule)
    suppress: Tensor
    started: float
    stats: SpecStats = field(default_factory=SpecStats)
    produced: int = 0
    target_len: int = 0  # positions in the slot's target row (committed - 1 between steps)
    draft_len: int = 0  # positions in the slot's draft row


@dataclass
class _Proposals:
    drafts: list[Tensor]  # per slot [k_b] (device)
    qs: list[Tensor | None]  # per slot [k_b, V], None = one-hot drafts
    fed: int  # draft positions fed per row this step (0: the draft model did not run)
    catch_up: bool = False  # the first draft forward also fed tokens committed by plain steps
    looked_up: list[bool] | None = None  # per slot: a hybrid's lookup drafted (None: no slot's)
    fed_rows: frozenset[int] | None = None  # the rows the draft model was fed (None: every row, when fed)
    tree: DraftTree | None = None  # a proposer's draft tree (one slot; drafts holds its nodes)

    def drafted(self, b: int) -> int:
        """Slot b's draft length as acceptance counts it (a tree: its depth)."""
        return self.tree.depth if self.tree is not None else int(self.drafts[b].shape[0])


class BatchDecoder:
    """Slots of one target (and one draft model, or n-gram lookup, or both: the hybrid; or none: plain batched
    decoding), or one request on any Target with any Proposer (``proposer``: how decode.generate runs)."""

    def __init__(
        self,
        target: Transformer | Target,
        *,
        slots: int,
        draft: Transformer | None = None,
        ngram: LookupProposer | None = None,
        proposer: Proposer | None = None,
        lookahead: Lookahead | None = None,
        max_context: int | None = None,
        prefix_cache: PrefixCache | None = None,
        lookup_k: int = HYBRID_LOOKUP_K,
        min_lookup: int = HYBRID_MIN_LOOKUP,
        shared_vocab: int | None = None,
    ) -> None:
        if min(lookup_k, min_lookup) < 1:
            raise ValueError("lookup_k and min_lookup must be >= 1")
        # what features a proposer reads from the target: False, True (the final-norm feature) or layer indices
        self.hidden_request = (proposer.wants_hidden or False) if proposer is not None else False
        if isinstance(target, Transformer) and proposer is None:
            self.target: BatchedModel | TargetRow = BatchedModel(target, max_rows=slots, max_len=max_context)
        else:  # one request, drafted by its own proposer (batch one), on whichever target it has
            if slots != 1 or draft is not None or ngram is not None or prefix_cache is not None:
                raise ValueError("a proposer drafts for one slot, with no draft model, lookup or prefix cache")
            if isinstance(target, Transformer):
                raise ValueError("a proposer's request runs on a Target (LocalTarget(model))")
            self.target = TargetRow(target, return_hidden=self.hidden_request)
        # a draft padding the vocabulary to another size drafts among the shared tokenizer's ids (engine/vocab.py)
        self.draft_width = draft_width(draft.vocab_size, target.vocab_size, shared_vocab) if draft is not None else 0
        self.draft = BatchedModel(draft, max_rows=slots, max_len=max_context) if draft is not None else None
        self.ngram = ngram
        self.proposer = proposer
        self.hybrid = draft is not None and ngram is not None  # the lookup first, the draft model where it finds little
        self.lookup_k, self.min_lookup = lookup_k, min_lookup
        self.lookahead = lookahead
        self.prefix_cache = prefix_cache
        self.slots = slots
        self.vocab_size = target.vocab_size
        self.max_context = min(m.max_len for m in (self.target, self.draft) if m is not None)
        self.device = self.target.device
        self._active: list[_Slot] = []
        self._done: list[SlotUpdate] = []  # requests that had nothing to generate

    def __len__(self) -> int:
        return len(self._active)

    @property
    def free(self) -> int:
        return self.slots - len(self._active)

    def add(
        self, key: Hashable, prompt_ids: list[int], config: GenerationConfig, *, ends_after: EndsAfter | None = None
    ) -> None:
        """Prefill the prompt into a free row; the request takes part in the next step.

        ends_after is asked for every committed token, in order, whether the request ends after it (a rule the step
        cannot see: a stop string, the end of a replayed output): its step is cut there, as at a stop token."""
        max_context = check_request(self, prompt_ids, config)  # type: ignore[arg-type]  # vocab_size/max_context
        if not self.free:
            raise BatchFullError(f"all {self.slots} batch slots are taken")
        slot = _Slot(
            key=key,
            config=config,
            params=config.sampling,
            committed=list(prompt_ids),
            max_context=max_context,
            generator=torch.Generator(device=self.device).manual_seed(config.seed),
            is_stop=stop_check(frozenset(config.stop_token_ids), ends_after),
            suppress=torch.tensor(sorted(config.suppress_ids), dtype=torch.long, device=self.device),
            started=time.perf_counter(),
        )
        if config.max_new_tokens <= 0 or len(prompt_ids) >= max_context:
            self._done.append(
                SlotUpdate(key=key, tokens=[], drafted=0, accepted=0, finish_reason="length", stats=slot.stats)
            )
            return
        prefill = len(prompt_ids) - 1  # every prompt token but the last, as LocalTarget
        if isinstance(self.target, TargetRow):
            self._start_request(prompt_ids)
        else:
            self._prefill_rows(slot, prompt_ids)
        slot.target_len = slot.draft_len = prefill
        slot.stats.prefill_s = time.perf_counter() - slot.started
        self._active.append(slot)

    def _start_request(self, prompt_ids: list[int]) -> None:
        """A proposer's request: the target's own prefill, the proposer's start (an EAGLE head: the prompt's
        features, all of them true, as if every token were accepted)."""
        hidden = self.target.prefill(prompt_ids)  # type: ignore[union-attr]
        if self.proposer is not None:
            self.proposer.begin(list(prompt_ids))
            if self.hidden_request and hidden is not None:
                self.proposer.observe_target(hidden, hidden.shape[0] - 1)

    def _prefill_rows(self, slot: _Slot, prompt_ids: list[int]) -> None:
        """The prompt into a free row of the target (and the draft), reusing the prefix cache's positions."""
        row, prefill = len(self._active), len(prompt_ids) - 1
        hit = self.prefix_cache.match(prompt_ids) if self.prefix_cache is not None else None
        for model, is_draft in ((self.target, False), (self.draft, True)):
            if model is None:
                continue
            model.reserve(row + 1, len(prompt_ids))
            reused, saved = 0, None
            if hit is not None:
                saved = hit.entry.draft if is_draft else hit.entry.target
                reused = hit.reusable(len(prompt_ids), draft=is_draft) if saved is not None else 0
            if reused:
                model.write_row(row, saved, reused)  # type: ignore[union-attr]
            if not is_draft:
                slot.stats.cached_prompt_tokens = reused
            if prefill > reused:
                feed = torch.tensor([prompt_ids[reused:-1]], device=self.device)
                model.forward(feed, [reused], first_row=row, last=[prefill - reused - 1])

    def remove(self, key: Hashable) -> SpecStats | None:
        """Drop a request (cancelled, or its caller ended it): its stats so far, None when it is not in the batch."""
        for row, slot in enumerate(self._active):
            if slot.key == key:
                slot.stats.output_tokens = slot.produced
                slot.stats.elapsed_s = time.perf_counter() - slot.started
                self._free_row(row)
                return slot.stats
        return None

    @torch.inference_mode()
    def step(self) -> list[SlotUpdate]:
        """One draft + verify for every active slot; returns each slot's committed tokens."""
        updates, self._done = self._done, []
        if not self._active:
            return updates
        batch_size = len(self._active)
        ks, chosen = self._lookaheads(batch_size)
        caps = self._lookup_caps(batch_size, chosen) if self.hybrid else []
        self._reserve(max(ks + caps))  # cache growth happens before the timed part (the lookahead's costs)
        t0 = time.perf_counter()
        proposals = self._hybrid_proposals(ks, caps) if self.hybrid else self._propose(ks)
        if self.lookahead is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # time the draft apart from the verification (measured costs)
        t1 = time.perf_counter()
        rows, hidden = self._verify(proposals)  # the step's one device read
        t2 = time.perf_counter()
        updates += self._commit(rows, proposals, hidden, draft_s=t1 - t0, verify_s=t2 - t1)
        if self.lookahead is not None:
            self.lookahead.observe(self._report(rows, proposals, draft_s=t1 - t0, verify_s=t2 - t1))
        finished = {u.key for u in updates if u.finish_reason}
        for row in range(len(self._active) - 1, -1, -1):  # leave after the step, highest row first
            if self._active[row].key in finished:
                self._free_row(row)
        return updates

    def _report(self, rows: list[list[int]], proposals: _Proposals, *, draft_s: float, verify_s: float) -> StepReport:
        """What the lookahead controller learns from the step: acceptance by kind (greedy or sampled; a hybrid's
        lookups apart), the draft and verification times and sizes."""
        counts = {True: [0, 0], False: [0, 0]}  # greedy? -> [accepted, reached] (the model's drafts)
        lookups = {True: [0, 0], False: [0, 0]}  # the same for a hybrid's lookups: their own estimates
        looked_up = proposals.looked_up or [False] * len(rows)
        for b, (slot, row, looked) in enumerate(zip(self._active, rows, looked_up, strict=True)):
            kind = (lookups if looked and self.hybrid else counts)[slot.params.greedy]
            drafted = proposals.drafted(b)
            kind[0] += min(row[0], drafted)
            kind[1] += min(row[0] + 1, drafted)
        width = max(len(d) for d in proposals.drafts)
        return StepReport(
            lookup=(*lookups[True], *lookups[False]),
            batch_size=len(rows),
            drafted=proposals.fed if self.hybrid else max(proposals.drafted(b) for b in range(len(rows))),
            verified=width + 1,
            accepted=counts[True][0],
            reached=counts[True][1],
            sampled_accepted=counts[False][0],
            sampled_reached=counts[False][1],
            draft_s=draft_s,
            verify_s=verify_s,
            catch_up=proposals.catch_up,
        )

    def _reserve(self, k_max: int) -> None:
        """Room for this step: the target gets [last committed, k_max drafts] after each row's cached positions;
        the draft its unseen committed tokens and k_max - 1 drafts."""
        rows, longest = len(self._active), max(len(s.committed) for s in self._active)
        self.target.reserve(rows, longest + k_max)
        if self.draft is not None and k_max:
            self.draft.reserve(rows, longest + k_max)

    def _lookaheads(self, batch_size: int) -> tuple[list[int], dict[bool, int]]:
        """Each slot's draft length this step (0 when nothing drafts), and the controller's K by kind (greedy?)."""
        if self.draft is None and self.ngram is None and self.proposer is None:
            return [0] * batch_size, {}
        chosen: dict[bool, int] = {}  # greedy? -> the controller's K for the slots that follow it
        if self.lookahead is not None:
            k_max = max(s.config.k for s in self._active)
            kinds = {s.params.greedy for s in self._active if s.params.greedy or not s.config.fixed_k}
            for greedy in sorted(kinds, reverse=True):  # greedy first; the step counts once
                chosen[greedy] = self.lookahead.choose(batch_size, k_max=k_max, sampled=not greedy, count=not chosen)
        ks = []
        for slot in self._active:
            follows = self.lookahead is not None and (slot.params.greedy or not slot.config.fixed_k)
            k = min(chosen[slot.params.greedy], slot.config.k) if follows else slot.config.k
            ks.append(
                step_lookahead(k, slot.produced, len(slot.committed), slot.config.max_new_tokens, slot.max_context)
            )
        return ks, chosen

    def _lookup_caps(self, batch_size: int, model_ks: dict[bool, int]) -> list[int]:
        """Each slot's lookup length this step for a hybrid: lookup_k, or what the controller chooses for the
        lookups at this load for the slots that follow it (greedy ones; sampled ones without a seed), beside the
        model's K it chose for their kind (model_ks)."""
        chosen: dict[bool, int] = {}
        caps = []
        for slot in self._active:
            greedy = slot.params.greedy
            if self.lookahead is None or not (greedy or not slot.config.fixed_k):
                caps.append(self.lookup_k)
                continue
            if greedy not in chosen:
                chosen[greedy] = self.lookahead.choose_lookup(
                    batch_size, k_max=self.lookup_k, sampled=not greedy, model_k=model_ks.get(greedy, 0)
                )
            caps.append(chosen[greedy])
        return caps

    def _propose(self, ks: list[int]) -> _Proposals:
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        if self.proposer is not None:
            return self._proposer_proposal(ks[0])
        if self.ngram is not None:
            drafts = [
                torch.tensor(self.ngram.lookup(s.committed, k), dtype=torch.long, device=self.device) if k else empty
                for s, k in zip(self._active, ks, strict=True)
            ]
            return _Proposals(drafts=drafts, qs=[None] * len(ks), fed=0)
        if self.draft is None or max(ks) == 0:
            return _Proposals(drafts=[empty] * len(ks), qs=[None] * len(ks), fed=0)
        return self._draft_model_proposals(self.draft, ks)

    def _proposer_proposal(self, k: int) -> _Proposals:
        """The one slot's proposer drafts k tokens (a tree proposer: of the shape the controller sized, if any)."""
        slot = self._active[0]
        if not k:
            return _Proposals(drafts=[torch.empty(0, dtype=torch.long, device=self.device)], qs=[None], fed=0)
        shape = getattr(self.lookahead, "shape", None)
        tree = {"tree": shape} if shape is not None else {}
        proposal = self.proposer.propose(slot.committed, k, slot.params, slot.generator, **tree)  # type: ignore[union-attr]
        return _Proposals(
            drafts=[proposal.tokens.to(self.device)],
            qs=[proposal.q],
            fed=0,
            looked_up=[proposal.looked_up],
            tree=proposal.tree,
        )

    def _hybrid_proposals(self, ks: list[int], caps: list[int]) -> _Proposals:
        """The lookup's draft where it finds at least min_lookup tokens (up to the slot's cap, within the request's
        budget), the draft model's (its K) for the other slots; a slot whose K is 0 drafts nothing from the model."""
        looked: list[list[int] | None] = []
        for slot, cap in zip(self._active, caps, strict=True):
            budget = step_lookahead(
                cap, slot.produced, len(slot.committed), slot.config.max_new_tokens, slot.max_context
            )
            looked.append(hybrid_lookup(self.ngram, slot.committed, budget, self.min_lookup))  # type: ignore[arg-type]
        model_ks = [0 if found is not None else k for found, k in zip(looked, ks, strict=True)]
        if max(model_ks):  # the draft model's forwards over the slots it drafts for only
            proposals = self._draft_model_proposals(self.draft, model_ks, only_drafting=True)  # type: ignore[arg-type]
        else:  # every drafting slot looked up: no model step (the draft rows catch up on their next one)
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            proposals = _Proposals(drafts=[empty] * len(ks), qs=[None] * len(ks), fed=0)
        for b, found in enumerate(looked):
            if found is not None:
                proposals.drafts[b] = torch.tensor(found, dtype=torch.long, device=self.device)
        proposals.looked_up = [found is not None for found in looked]
        return proposals

    def _draft_model_proposals(self, draft: BatchedModel, ks: list[int], *, only_drafting: bool = False) -> _Proposals:
        """K = max(ks) draft forwards over all rows: the first feeds each row's unseen committed tokens, the
        next ones the previous draft token (proposers.draft_chain). A slot samples (or takes the argmax of) its first
        k_b only.
        only_drafting: over the rows whose k_b > 0 only (a hybrid: the slots its lookup served are not fed, and
        catch up on their next model step)."""
        every = self._active
        rows = [b for b, k in enumerate(ks) if k > 0] if only_drafting else list(range(len(every)))
        slots, sub_ks = [every[b] for b in rows], [ks[b] for b in rows]
        k_max = max(sub_ks)
        subset = rows if only_drafting else None
        # a target's padding id past the draft's vocabulary (never text) is read as its last id
        top = draft.vocab_size - 1
        feeds = [torch.tensor(s.committed[s.draft_len :], device=self.device).clamp_max(top) for s in slots]
        starts = [s.draft_len for s in slots]
        last = [len(s.committed) - s.draft_len - 1 for s in slots]
        width = self.draft_width
        logits = draft.forward(pad_sequence(feeds, batch_first=True), starts, last=last, rows=subset)[:, :width]
        positions = [len(s.committed) for s in slots]  # where each row's first draft goes
        zeros = [0] * len(slots)

        def forward(tokens: Tensor, j: int) -> Tensor:  # draft j of every row, each at its own position
            return draft.forward(tokens[:, None], [p + j for p in positions], last=zeros, rows=subset)[:, :width]

        params, generators = [s.params for s in slots], [s.generator for s in slots]
        drafted, qs = draft_chain(
            logits, forward, sub_ks, params, generators, width=width, vocab_size=self.vocab_size
        )  # [B, K], per row [k_b, V] or None
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        drafts, row_qs = [empty] * len(every), [None] * len(every)
        for b, row in enumerate(rows):
            drafts[row] = drafted[b, : sub_ks[b]]
            row_qs[row] = qs[b]
        return _Proposals(
            drafts=drafts,
            qs=row_qs,
            fed=k_max,
            catch_up=max(last) > 1,  # more than [d_K, bonus] of the last step: plain steps ran in between
            fed_rows=frozenset(rows) if only_drafting else None,
        )

    def _verify(self, proposals: _Proposals) -> tuple[list[list[int]], Tensor | None]:
        """One target forward over [last committed, drafts] of every row -> per slot [accepted, tokens...], and
        the target's features along the kept positions when a proposer reads them (one slot)."""
        slots = self._active
        if proposals.tree is not None:  # a draft tree: one pass over all its nodes, the accepted path kept
            slot = slots[0]
            verdict = verify_tree_step(
                self.target.target,  # type: ignore[union-attr]  # a tree's proposer runs on a TargetRow
                slot.committed[-1],
                proposals.tree,
                slot.params,
                slot.generator,
                produced=slot.produced,
                min_tokens=slot.config.min_tokens,
                suppress=slot.suppress,
                return_hidden=self.hidden_request,
            )
            return [[verdict.num_accepted, *verdict.tokens]], verdict.hidden
        lasts = torch.tensor([s.committed[-1] for s in slots], device=self.device)
        feeds = [torch.cat([lasts[b : b + 1], d]) for b, d in enumerate(proposals.drafts)]
        width = max(f.shape[0] for f in feeds)
        starts = [s.target_len for s in slots]
        logits = self.target.forward(pad_sequence(feeds, batch_first=True), starts)  # [B, T, V]
        results = []
        for b, slot in enumerate(slots):
            drafts = proposals.drafts[b]
            rows = logits[b, : drafts.shape[0] + 1]  # [k_b + 1, V]
            rows = suppress_before_min_tokens(rows, slot.produced, slot.config.min_tokens, slot.suppress)
            if slot.params.greedy:
                num_accepted, tokens = verify_greedy(drafts, rows)
            else:
                p = probs_from_logits(rows, slot.params)
                num_accepted, tokens = verify_sampled(drafts, proposals.qs[b], p, slot.generator)
            row = torch.cat([num_accepted.view(1), tokens])
            results.append(torch.nn.functional.pad(row, (0, width - tokens.shape[0])))
        hidden = self.target.hidden if isinstance(self.target, TargetRow) else None
        return torch.stack(results).tolist(), hidden  # [B, 1 + T]: the one device read of the step

    def _commit(
        self, rows: list[list[int]], proposals: _Proposals, hidden: Tensor | None, *, draft_s: float, verify_s: float
    ) -> list[SlotUpdate]:
        updates = []
        looked_up = proposals.looked_up or [False] * len(rows)
        for b, (slot, row, looked) in enumerate(zip(self._active, rows, looked_up, strict=True)):
            drafted = proposals.drafted(b)
            accepted, new = row[0], row[1 : row[0] + 2]
            new, accepted_counted, reached, stopped = truncate_at_stop(new, accepted, drafted, slot.is_stop)
            before = len(slot.committed)
            slot.target_len = before + accepted  # keeps [last committed, accepted drafts]
            self.target.keep(b, slot.target_len)
            if self.proposer is not None:
                self.proposer.on_verified(accepted, drafted)
                if self.hidden_request and hidden is not None:
                    self.proposer.observe_target(hidden, accepted)
            if proposals.fed and (proposals.fed_rows is None or b in proposals.fed_rows):
                # drafts 1..fed-1 were fed to the draft row; the accepted ones stay valid (a hybrid's row is fed
                # only when its slot drafted with the model)
                slot.draft_len = before + min(accepted, proposals.fed - 1)
            slot.committed.extend(new)
            slot.produced += len(new)
            slot.stats.record_step(drafted=drafted, accepted=accepted_counted, reached=reached, looked_up=looked)
            slot.stats.draft_s += draft_s
            slot.stats.verify_s += verify_s
            finish = None
            if stopped:
                finish = "stop"
            elif slot.produced >= slot.config.max_new_tokens or len(slot.committed) >= slot.max_context:
                finish = "length"
            if finish:
                slot.stats.output_tokens = slot.produced
                slot.stats.elapsed_s = time.perf_counter() - slot.started
            updates.append(
                SlotUpdate(
                    key=slot.key,
                    tokens=new,
                    drafted=drafted,
                    accepted=accepted_counted,
                    looked_up=looked,
                    finish_reason=finish,
                    stats=slot.stats if finish else None,
                )
            )
        return updates

    def _free_row(self, row: int) -> None:
        """The last row moves into the freed one (its cached positions only), so rows stay 0..n-1. The freed row's
        positions go to the prefix cache first."""
        slot = self._active[row]
        if self.prefix_cache is not None and slot.target_len >= self.prefix_cache.min_match:
            draft = self.draft.read_row(row, slot.draft_len) if self.draft is not None else None
            self.prefix_cache.put(
                slot.committed[: slot.target_len], self.target.read_row(row, slot.target_len), draft, slot.draft_len
            )
        last = len(self._active) - 1
        if row != last:
            moved = self._active[last]
            self.target.move_row(last, row, moved.target_len)
            if self.draft is not None:
                self.draft.move_row(last, row, moved.draft_len)
            self._active[row] = moved
        self._active.pop()
