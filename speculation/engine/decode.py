"""The decode loop: draft, verify in one target pass, commit, roll back; plain decoding for baselines.

``generate(target, proposer, prompt_ids, config)`` returns the tokens and a SpecStats. With temperature 0
the output equals plain greedy decoding of the target; with temperature > 0 it is distributed exactly as
the target's (processed) distribution. The loop reads the device once per step (accepted count and tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speculation.engine.errors import ContextLengthError, EmptyPromptError, VocabMismatchError
from speculation.engine.lookahead import DEFAULT_K, DynamicLookahead, Lookahead, StepReport, TreeLookahead, check_k
from speculation.engine.proposers import Proposal, Proposer
from speculation.engine.sampling import SamplingParams, probs_from_logits, suppress_before_min_tokens
from speculation.engine.stats import SpecStats
from speculation.engine.target import Target
from speculation.engine.tree import TreeShape, verify_tree_step
from speculation.engine.verify import verify_greedy, verify_sampled

OnTokens = Callable[[list[int]], "bool | None"]  # returns True to end the request after these tokens
EndsAfter = Callable[[int], bool]  # asked for each committed token in order: does the request end after it?


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    k: int = DEFAULT_K
    dynamic_k: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's min_tokens: the target may not produce suppress_ids before min_tokens output tokens.
    min_tokens: int = 0
    suppress_ids: tuple[int, ...] = ()
    seed: int = 0
    max_context: int | None = None  # None: the target's
    # a sampled request keeps K (the batch loop's controller does not choose it), so that the same seed gives the same
    # tokens whatever the load; False for a request that set no seed (nothing to reproduce: any K is as exact)
    fixed_k: bool = True

    def __post_init__(self) -> None:
        if self.k != 0:  # K = 0: plain decoding through the same loop (what a speculative step is compared with)
            check_k(self.k)
        self.sampling  # validates temperature / top_k / top_p  # noqa: B018
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only (a stop token, when hit, is the last one)
    stats: SpecStats
    finish_reason: str  # "stop" | "length"
    k_history: list[int] = field(default_factory=list)  # K used at each step (dynamic K)


def step_lookahead(k: int, emitted: int, committed: int, max_new_tokens: int, max_context: int) -> int:
    """How many drafts a step may carry: the step commits at most k + 1 tokens, within both limits.

    Shared with the shadow replay, so both agree on the last steps of a request.
    """
    return max(0, min(k, max_new_tokens - emitted - 1, max_context - committed - 1))


def check_request(target: Target, prompt_ids: list[int], config: GenerationConfig) -> int:
    if not prompt_ids:
        raise EmptyPromptError("the prompt has no tokens")
    max_context = min(config.max_context or target.max_context, target.max_context)
    if len(prompt_ids) > max_context:
        raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens; the context holds {max_context}")
    if max(prompt_ids) >= target.vocab_size or min(prompt_ids) < 0:
        raise VocabMismatchError(f"prompt token ids must be in [0, {target.vocab_size})")
    return max_context


def generate(
    target: Target,
    proposer: Proposer | None,
    prompt_ids: list[int],
    config: GenerationConfig,
    on_tokens: OnTokens | None = None,
    *,
    lookahead: Lookahead | None = None,
    ends_after: EndsAfter | None = None,
) -> GenerationResult:
    """Speculative decoding (plain decoding when proposer is None).

    on_tokens gets each step's committed tokens (to stream them); returning True ends the request after them.
    ends_after is asked for every committed token, in order, whether the request ends after it (a rule the loop
    cannot see: a stop string, the end of a replayed output): the step is cut there, as at a stop token, and the
    stats count only the drafts that were kept.

    With ``config.dynamic_k``, pass the same ``lookahead`` to successive requests (one per target/draft pair)
    so its acceptance and cost estimates carry over; by default each request starts a fresh one (a TreeLookahead
    for a draft-tree proposer: it sizes the tree's width too, and the loop hands each step's shape to the proposer).
    """
    max_context = check_request(target, prompt_ids, config)
    if not config.dynamic_k:
        lookahead = None
    elif lookahead is None:
        lookahead = default_lookahead(proposer, config.k)
    run = _Run(target, proposer, config, ends_after)
    committed, out, k_history = list(prompt_ids), [], []
    finish = "length"
    started = time.perf_counter()
    run.start(committed)
    run.stats.prefill_s = time.perf_counter() - started
    while True:
        k = step_lookahead(
            lookahead.choose(1) if lookahead else config.k, len(out), len(committed), config.max_new_tokens, max_context
        )
        if len(out) >= config.max_new_tokens or len(committed) >= max_context:
            break
        step = run.step(committed, k, produced=len(out), tree=getattr(lookahead, "shape", None))
        if lookahead is not None:
            reached = min(step.accepted + 1, step.drafted)
            lookahead.observe(
                StepReport(
                    drafted=step.drafted,
                    accepted=step.accepted,
                    reached=reached,
                    draft_s=step.draft_s,
                    verify_s=step.verify_s,
                    verified=step.verified,
                )
            )
            k_history.append(step.drafted)
        committed.extend(step.new)
        out.extend(step.new)
        if on_tokens is not None and on_tokens(step.new):
            step.stopped = True  # the caller ended the request (a stop string matched)
        if step.stopped:
            finish = "stop"
            break
    run.stats.output_tokens = len(out)
    run.stats.elapsed_s = time.perf_counter() - started
    return GenerationResult(tokens=out, stats=run.stats, finish_reason=finish, k_history=k_history)


def default_lookahead(proposer: Proposer | None, k: int) -> DynamicLookahead:
    """Dynamic K for this proposer: a TreeLookahead over its tree's family when it drafts trees (EagleProposer)."""
    tree = getattr(proposer, "tree", None)
    if tree is not None:
        return TreeLookahead.for_tree(tree, k_max=k, k_start=k)
    return DynamicLookahead(k_max=k, k_start=k)


@dataclass
class _Step:
    new: list[int]  # the committed tokens (cut at the request's end)
    accepted: int  # accepted drafts (before the cut: what the lookahead learns from)
    drafted: int  # drafts (a tree: its depth)
    draft_s: float
    verify_s: float
    stopped: bool
    verified: int = 0  # tokens the target pass checked (a tree: its nodes + 1)


class _Run:
    """One request's state inside ``generate``: draft, verify in one target pass, cut, commit, roll back."""

    def __init__(self, target: Target, proposer: Proposer | None, config: GenerationConfig, ends_after) -> None:
        self.target, self.proposer, self.config = target, proposer, config
        self.params = config.sampling
        self.generator = torch.Generator(device=target.device).manual_seed(config.seed)
        self.stats = SpecStats()
        self.is_stop = _stop_check(frozenset(config.stop_token_ids), ends_after)
        self.suppress = torch.tensor(sorted(config.suppress_ids), dtype=torch.long, device=target.device)
        # what features the proposer reads: False, True (the final-norm feature) or layer indices (EAGLE-3)
        self.hidden_request = (proposer.wants_hidden or False) if proposer is not None else False

    def start(self, committed: list[int]) -> None:
        wants = self.hidden_request
        prefilled = self.target.prefill(committed, return_hidden=wants) if wants else self.target.prefill(committed)
        if self.proposer is not None:
            self.proposer.begin(committed)
            if wants and prefilled is not None and prefilled.hidden is not None:
                # EAGLE: the prompt's features, all of them true (as if every token were accepted).
                self.proposer.observe_target(prefilled.hidden, prefilled.hidden.shape[0] - 1)

    def step(self, committed: list[int], k: int, *, produced: int, tree: TreeShape | None = None) -> _Step:
        """tree: this step's draft-tree shape (TreeLookahead's choice; None: the proposer's own)."""
        proposer, target = self.proposer, self.target
        shape = {"tree": tree} if tree is not None else {}
        t0 = time.perf_counter()
        proposal = proposer.propose(committed, k, self.params, self.generator, **shape) if proposer and k else _EMPTY
        t1 = time.perf_counter()
        verified = int(proposal.tokens.shape[0]) + 1
        if proposal.tree is not None:  # a draft tree: one pass over all its nodes, the accepted path kept
            drafted = proposal.tree.depth
            accepted, new, hidden = self._verify_tree(committed[-1], proposal, produced)
        else:
            drafted = int(proposal.tokens.shape[0])  # shape only: no device read
            accepted, new, hidden = self._verify_chain(committed[-1], proposal, produced)
        t2 = time.perf_counter()
        new, accepted_counted, reached, stopped = truncate_at_stop(new, accepted, drafted, self.is_stop)
        target.rollback(len(committed) + accepted)  # keeps [last committed, accepted drafts]
        if proposer is not None:
            proposer.on_verified(accepted, drafted)
            if self.hidden_request and hidden is not None:
                proposer.observe_target(hidden, accepted)
        self.stats.record_step(
            drafted=drafted, accepted=accepted_counted, reached=reached, looked_up=proposal.looked_up
        )
        self.stats.draft_s += t1 - t0
        self.stats.verify_s += t2 - t1
        return _Step(new, accepted, drafted, t1 - t0, t2 - t1, stopped, verified)

    def _verify_chain(self, last_token: int, proposal: Proposal, produced: int):
        drafts = proposal.tokens.to(self.target.device)
        last = torch.tensor([last_token], device=self.target.device)
        result = self.target.forward(torch.cat([last, drafts]), return_hidden=self.hidden_request)  # [K+1, V]
        logits = suppress_before_min_tokens(result.logits, produced, self.config.min_tokens, self.suppress)
        if self.params.greedy:
            num_accepted, tokens = verify_greedy(drafts, logits)
        else:
            p = probs_from_logits(logits, self.params)
            num_accepted, tokens = verify_sampled(drafts, proposal.q, p, self.generator)
        step = torch.cat([num_accepted.view(1), tokens]).tolist()  # the one device read of the step
        return step[0], step[1 : step[0] + 2], result.hidden

    def _verify_tree(self, last_token: int, proposal: Proposal, produced: int):
        verdict = verify_tree_step(
            self.target,
            last_token,
            proposal.tree,
            self.params,
            self.generator,
            produced=produced,
            min_tokens=self.config.min_tokens,
            suppress=self.suppress,
            return_hidden=self.hidden_request,
        )
        return verdict.num_accepted, verdict.tokens, verdict.hidden


def generate_plain(
    target: Target, prompt_ids: list[int], config: GenerationConfig, on_tokens: OnTokens | None = None
) -> GenerationResult:
    """Plain decoding through the same target and loop: one target pass per token (the baseline)."""
    return generate(target, None, prompt_ids, config, on_tokens)


def _stop_check(stop_ids: frozenset[int], ends_after: EndsAfter | None) -> Callable[[int], bool]:
    if ends_after is None:
        return stop_ids.__contains__

    def is_stop(token: int) -> bool:
        ended = ends_after(token)  # asked once for every kept token, in order
        return ended or token in stop_ids

    return is_stop


def truncate_at_stop(
    new: list[int], accepted: int, drafted: int, stop: Callable[[int], bool] | frozenset[int]
) -> tuple[list[int], int, int, bool]:
    """Cut a step's tokens after the first one that ends the request (stop: the stop token ids, or a check
    asked once per token in order); count only drafts that were emitted.

    (tokens kept, accepted drafts kept, positions reached, stopped). Also for steps committed outside this loop
    (the batched step, the worker's batch loop), so every step is counted alike.
    """
    is_stop = stop if callable(stop) else stop.__contains__
    reached = min(accepted + 1, drafted)
    for i, token in enumerate(new):
        if is_stop(token):
            if i < accepted:  # the stop token is an accepted draft: drafts after it are never emitted
                return new[: i + 1], i + 1, i + 1, True
            return new[: i + 1], accepted, reached, True
    return new, accepted, reached, False


_EMPTY = Proposal(tokens=torch.empty(0, dtype=torch.long), q=None)
