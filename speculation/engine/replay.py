"""Shadow replay: what speculation with lookahead K would have done on a finished request, through ``generate``.

The replay runs the one decode loop (``speculation.engine.decode.generate``) on a ``ReplayTarget``: a target
that knows the output the server produced, so its "verification" of a draft compares it with the known token at
that position. Every greedy step then commits exactly what prod would have committed (the known tokens), and
the loop's own lookahead rule, stop truncation and stats apply unchanged.

Draft model: in greedy speculation an accepted draft token equals the target's token, so the draft always
proposes from the true prefix: at committed length n it proposes its teacher-forced greedy predictions
draft_next[n-1], draft_next[n], ... and the step accepts them while they equal the known tokens (a later
prediction differs from the autoregressive draft only after a mismatch, where the step has already stopped).
One teacher-forced draft pass over prompt + output (``draft_greedy_predictions``) therefore replays every step
exactly (``replay_greedy``). Proposers that are a function of the context (n-gram) replay as themselves.
An EAGLE head replays as itself too, fed the target's true features of the known sequence (``hidden``): a chain
as any proposer, a draft tree (EAGLE-2) through ``ReplayTarget.replay_tree_step``, which verifies the tree
against the known output (``tree.replay_tree_greedy``) where prod's tree step would run the target.

Sampled requests. A one-hot draft token d (a lookup's: n-gram, suffix decoding, a hybrid's looked-up steps) passes
with probability p(d), and on a rejection the token is drawn from p with d removed: the step's token equals d exactly
when d passed. Given the output the server sampled (a sample of p, as speculative decoding's output is), every
lookup step is therefore known: the same replay as greedy's, against the sampled output, is exact. A draft model's
sampled draft passes with a probability, not a certainty: ``expected_hybrid`` carries the probability of each
position being a step's start through the request (the model's drafts passing position by position with the
probability that a sampled draft passed given the token o sampled there, min(1, q(o) / p(o)); the lookup's steps
known) and gives the expected counts. Given the output these passes are independent, so the counts are exact in
expectation over the target's samples (tests/speculation/engine/test_engine_sampled_replay.py checks it against
real sampled runs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from speculation.engine.decode import generate
from speculation.engine.errors import EmptyPromptError
from speculation.engine.lookahead import DynamicLookahead, check_k
from speculation.engine.model import Transformer
from speculation.engine.proposers import Proposal, Proposer
from speculation.engine.request import GenerationConfig, step_lookahead
from speculation.engine.sampling import SamplingParams
from speculation.engine.stats import SpecStats
from speculation.engine.target import TargetOutput
from speculation.engine.tree import DraftTree, TreeStep, replay_tree_greedy

UNBOUNDED = 1 << 62  # no context limit of its own: the request's, when given, applies


class ReplayTarget:
    """The Target protocol over a known token sequence (prompt + the output the server produced); greedy only.

    Row j of a forward over positions [n, n + T) is one-hot (0 at the known token at position n + j + 1, -inf
    elsewhere), so its argmax is what the target produced there. Rows past the end of the known sequence are
    uniform: the replay ends at the end of the output (``ends_after``), so they never decide a step.
    hidden [len(tokens), D]: the target's features of the known sequence (one teacher-forced pass), for
    proposers that read them (EAGLE); a forward returns those of the positions it covers.
    """

    def __init__(
        self,
        tokens: Sequence[int],
        *,
        vocab_size: int | None = None,
        max_context: int = UNBOUNDED,
        hidden: Tensor | None = None,
    ):
        self.known = list(tokens)
        self.vocab_size = vocab_size or (max(self.known) + 1 if self.known else 1)
        self.max_context = max_context
        self.hidden = hidden
        self.device = torch.device("cpu") if hidden is None else hidden.device
        self.length = 0

    def prefill(self, prompt_ids: list[int], *, return_hidden: bool = False) -> TargetOutput | None:
        self.length = max(0, len(prompt_ids) - 1)
        if not return_hidden or self.hidden is None or not self.length:
            return None
        return TargetOutput(logits=torch.empty(0, self.vocab_size), hidden=self.hidden[: self.length])

    def forward(self, tokens: Tensor, *, return_hidden: bool = False) -> TargetOutput:
        t = int(tokens.shape[0])
        logits = torch.zeros(t, self.vocab_size, device=self.device)  # [T, V]
        for row in range(t):
            position = self.length + row + 1
            if position < len(self.known):
                logits[row].fill_(float("-inf"))
                logits[row, self.known[position]] = 0.0
        hidden = None
        if return_hidden and self.hidden is not None:
            hidden = self.hidden[self.length : self.length + t]  # [T, D]: true where the fed tokens are known
            if hidden.shape[0] < t:
                hidden = torch.cat([hidden, hidden.new_zeros(t - hidden.shape[0], hidden.shape[1])])
        self.length += t
        return TargetOutput(logits=logits, hidden=hidden)

    def replay_tree_step(
        self, tree: DraftTree, params: SamplingParams, *, return_hidden: bool | tuple[int, ...] = False
    ) -> TreeStep:
        """A draft tree's greedy verification against the known output (``tree.replay_tree_greedy``), as
        ``tree.verify_tree_step`` does with a target in the process: the accepted path's tokens, then the known
        token after it; the features of the root and the accepted nodes (true: they are the known tokens)."""
        if not params.greedy:
            raise ValueError("a replay verifies greedy speculation only")
        start = self.length  # the root (the last committed token) sits at position start
        known = torch.tensor(self.known[start + 1 :], dtype=torch.long)
        num_accepted, _, emitted = replay_tree_greedy(tree, known)
        accepted = int(num_accepted)
        self.length = start + accepted + 1
        hidden = None
        if return_hidden and self.hidden is not None:
            hidden = self.hidden[start : start + accepted + 1]
        return TreeStep(num_accepted=accepted, tokens=emitted[: accepted + 1].tolist(), hidden=hidden)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} positions are cached")
        self.length = length


Propose = Callable[[int, int], Sequence[int]]  # (committed length n, at most this many) -> the drafts


class KnownDrafts:
    """A proposer whose greedy drafts depend only on the committed tokens: propose(n, d) gives at most d drafts
    after the first n tokens (an n-gram lookup, or any candidate replayed from the known output)."""

    wants_hidden = False

    def __init__(self, propose: Propose):
        self.propose_at = propose

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        if not params.greedy:
            raise ValueError("drafts replayed from the known output replay greedy speculation only")
        drafts = list(self.propose_at(len(committed), k))[:k]
        return Proposal(tokens=torch.tensor(drafts, dtype=torch.long), q=None)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        pass


def replay_proposer(
    proposer: Proposer,
    target_tokens: Sequence[int],
    k: int,
    *,
    prompt_len: int,
    max_new_tokens: int | None = None,
    max_context: int | None = None,
    hidden: Tensor | None = None,
    lookahead: DynamicLookahead | None = None,
) -> SpecStats:
    """Greedy speculation with this proposer on a finished request, replayed through ``generate``.

    target_tokens: prompt followed by the target's output (a stop token, when it ended the output, last).
    max_new_tokens / max_context: the request's limits, as generate applied them (max_context: the target's
    context when the request set none; None here = unbounded). They shorten the last steps as in generate.
    hidden: the target's features of target_tokens, for a proposer that reads them (an EAGLE head).
    lookahead: K chosen per step by this controller within k (``ModeledLookahead``: over a calibration's costs);
    None: K = k every step.
    """
    check_k(k)
    if prompt_len < 1:
        raise EmptyPromptError("the prompt has no tokens")
    output_len = len(target_tokens) - prompt_len
    if output_len <= 0:
        return SpecStats()
    config = GenerationConfig(
        max_new_tokens=output_len if max_new_tokens is None else max_new_tokens,
        k=k,
        max_context=max_context,
        dynamic_k=lookahead is not None,
    )
    produced = 0

    def ends_after(token: int) -> bool:  # the output ended here (stop token, stop string, length or context)
        nonlocal produced
        produced += 1
        return produced >= output_len

    target = ReplayTarget(target_tokens, hidden=hidden)
    prompt = list(target_tokens[:prompt_len])
    return generate(target, proposer, prompt, config, ends_after=ends_after, lookahead=lookahead).stats


def teacher_forced(draft_next_tokens: Sequence[int]) -> KnownDrafts:
    """A draft model's greedy drafts from its teacher-forced predictions (``draft_greedy_predictions``): its chain
    after n committed tokens is accepted exactly as far as these predictions match, so a greedy replay with them is
    exact. Padded past the known predictions (those positions are never counted)."""

    def drafts(n: int, d: int) -> list[int]:
        found = list(draft_next_tokens[n - 1 : n - 1 + d])
        return found + [0] * (d - len(found))

    return KnownDrafts(drafts)


def replay_greedy(
    draft_next_tokens: Sequence[int],
    target_tokens: Sequence[int],
    k: int,
    *,
    prompt_len: int,
    max_new_tokens: int | None = None,
    max_context: int | None = None,
    lookahead: DynamicLookahead | None = None,
) -> SpecStats:
    """Replay a draft model's greedy speculation on one request (see ``replay_proposer``).

    draft_next_tokens[i]: the draft's greedy prediction for position i + 1 given tokens[0..i] (teacher forced,
    from ``draft_greedy_predictions``), for at least the first len(target_tokens) - 1 positions.
    """
    if len(draft_next_tokens) < len(target_tokens) - 1:
        raise ValueError("need the draft's prediction at every position but the last")
    return replay_proposer(
        teacher_forced(draft_next_tokens),
        target_tokens,
        k,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        max_context=max_context,
        lookahead=lookahead,
    )


def replay_proposals(
    propose: Propose,
    target_tokens: Sequence[int],
    k: int,
    *,
    prompt_len: int,
    max_new_tokens: int | None = None,
    max_context: int | None = None,
) -> SpecStats:
    """Replay greedy speculation with drafts that depend only on the committed tokens (see ``KnownDrafts``):
    exact for n-gram prompt lookup and for a draft model's teacher-forced predictions. A step with no drafts is
    a plain step."""
    return replay_proposer(
        KnownDrafts(propose),
        target_tokens,
        k,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        max_context=max_context,
    )


@torch.inference_mode()
def draft_greedy_predictions(
    draft: Transformer, token_ids: Sequence[int], *, chunk: int = 256, width: int | None = None
) -> list[int]:
    """The draft's teacher-forced greedy next token after every prefix: [i] predicts token_ids[i + 1]; among its
    first ``width`` ids when given (a draft padded to another vocabulary size than its target's: engine/vocab.py)."""
    if not token_ids:
        return []
    device = draft.output.weight.device
    ids = torch.tensor(list(token_ids), device=device)
    if ids.numel() > draft.max_len:
        raise ValueError(f"sequence of {ids.numel()} tokens exceeds the draft's cache of {draft.max_len}")
    preds = [draft(ids[s : s + chunk], s).logits[:, :width].argmax(-1) for s in range(0, ids.numel(), chunk)]
    return torch.cat(preds).tolist()


def expected_acceptance(target_logprobs: Sequence[dict[int, float]], draft_probs: torch.Tensor) -> float:
    """Mean over positions of sum_x min(p(x), q(x)) = 1 - TV(p, q): the expected per-position acceptance.

    target_logprobs[i]: the target's log-probabilities at position i (token id -> logprob; top-N from a
    server is fine: the mass it leaves out counts as disagreement, so the estimate is a lower bound).
    draft_probs: [positions, V] the draft's (processed) probabilities at the same positions.
    """
    if len(target_logprobs) != draft_probs.shape[0]:
        raise ValueError("one target distribution per draft position is needed")
    if not target_logprobs:
        return 0.0
    total = 0.0
    q = draft_probs.float().cpu()
    for i, dist in enumerate(target_logprobs):
        ids = torch.tensor(list(dist.keys()), dtype=torch.long)
        p = torch.tensor([math.exp(v) for v in dist.values()])
        total += torch.minimum(p, q[i, ids]).sum().item()
    return total / len(target_logprobs)


def expected_hybrid(
    lookup: Callable[[int, int], list[int]] | None,
    alphas: Sequence[float],
    target_tokens: Sequence[int],
    model_k: int,
    *,
    prompt_len: int,
    lookup_k: int,
    min_lookup: int,
    max_new_tokens: int | None = None,
    chains: Sequence[Sequence[float]] | None = None,
) -> SpecStats:
    """The expected stats of a hybrid (``HybridProposer``) on a finished sampled request; the counts are
    expectations (floats). lookup(n, d): the lookup's drafts (at most d) after the first n tokens of target_tokens;
    alphas[i]: the probability that the draft model's draft for output position i passed, given the token o sampled
    there: min(1, q(o) / p(o)), p and q processed as the request asked (its average over o, sum_x min(p, q), where
    p(o) is not known: a lower bound). A step starting at output position i asks the lookup for up to
    step_lookahead(lookup_k, ...) tokens: at least min_lookup of them are verified as they are (passing exactly as
    far as they equal the sampled output), fewer and the model drafts min(that, model_k), its j-th draft passing
    with probability alphas[i + j] once the earlier ones passed. lookup None: the draft model alone, drafting
    min(lookup_k, model_k) (pass lookup_k = model_k). chains: where a draft's pass depends on the step's start too
    (an EAGLE head's chain, drafted from the target's features at the start), chains[i][j] in place of
    alphas[i + j]; a chain shorter than the step's K drafts that many (none: a plain step)."""
    check_k(model_k)
    if prompt_len < 1:
        raise EmptyPromptError("the prompt has no tokens")
    n = len(target_tokens) - prompt_len
    if len(alphas) < n:
        raise ValueError("need the draft's acceptance at every output position")
    budget = n if max_new_tokens is None else max_new_tokens
    stats = SpecStats(output_tokens=max(n, 0))
    for name in ("accepted_per_position", "drafted_per_position", "reached_per_position"):
        setattr(stats, name, [0.0] * max(lookup_k, model_k))
    stats.accepted_length_histogram = [0.0] * (max(lookup_k, model_k) + 1)
    start = [0.0] * (n + 1)  # start[i]: the probability that a step starts at output position i
    if n > 0:
        start[0] = 1.0
    outputs = target_tokens[prompt_len:]
    for i in range(n):
        mass = start[i]
        if mass <= 0.0:
            continue
        d = step_lookahead(lookup_k, i, prompt_len + i, budget, UNBOUNDED)
        stats.target_passes += mass
        if d == 0:  # a plain step
            start[i + 1] += mass
            continue
        drafts = list(lookup(prompt_len + i, d))[:d] if lookup is not None else []
        if drafts and len(drafts) >= min_lookup:
            accepted = 0
            while accepted < len(drafts) and i + accepted < n and drafts[accepted] == outputs[i + accepted]:
                accepted += 1
            _expect(stats, mass, len(drafts), accepted, looked_up=True)
            start[min(n, i + accepted + 1)] += mass
            continue
        drafted = min(d, model_k, len(chains[i])) if chains is not None else min(d, model_k)
        if drafted == 0:  # nothing to draft here: a plain step
            start[i + 1] += mass
            continue
        reach = mass
        for j in range(drafted + 1):  # j drafts passed, then a rejection (or all passed: the bonus token)
            if j < drafted and i + j < n:
                passes = chains[i][j] if chains is not None else alphas[i + j]
            else:
                passes = 0.0
            ends = reach * (1.0 - passes) if j < drafted else reach
            if ends > 0.0:
                _expect(stats, ends, drafted, j, looked_up=False)
                start[min(n, i + j + 1)] += ends
            reach *= passes
            if reach <= 0.0:
                break
    return stats


def _expect(stats: SpecStats, mass: float, drafted: int, accepted: int, *, looked_up: bool) -> None:
    """SpecStats.record_step weighted by the probability of the step (the pass itself is counted by the caller)."""
    if looked_up:
        stats.looked_up_tokens += mass * drafted
    stats.drafts += mass
    stats.drafted_tokens += mass * drafted
    stats.accepted_tokens += mass * accepted
    for i in range(drafted):
        stats.drafted_per_position[i] += mass
    for i in range(min(accepted + 1, drafted)):
        stats.reached_per_position[i] += mass
    for i in range(accepted):
        stats.accepted_per_position[i] += mass
    stats.accepted_length_histogram[accepted] += mass
