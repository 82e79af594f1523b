"""Choosing K, the lookahead: fixed, or the K that maximises expected tokens per unit time.

Dynamic K (ANCHORS section 1): with per-position acceptance alpha, a step with K drafts commits
E[N] = (1 - alpha^(K+1)) / (1 - alpha) tokens and costs verify(K + 1 tokens) + K * draft_step. alpha is a
decayed estimate from the accepted counts (accepted / positions reached); the costs are decayed averages of
measured wall time, verify cost kept per number of tokens verified (on a CPU it is far from linear: a few
rows cost what one row costs, then the matrix kernel changes). K = 0 (a plain step) is a candidate too, so
speculation backs off when the draft does not pay; every ``PROBE_EVERY`` plain steps one draft step probes
whether the acceptance came back. For a draft-tree proposer (engine/tree.py) K caps the tree's depth: the
step's accepted path is what alpha counts, and the measured costs are the tree's (draft time per level,
verification time of the whole tree at that depth), so the same rule sizes the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculation.engine.errors import LookaheadError
from speculation.engine.projection import expected_tokens, verify_cost
from speculation.limits import K_MAX, K_MIN

__all__ = ["DEFAULT_K", "K_MAX", "K_MIN", "DynamicLookahead", "check_k", "expected_tokens"]

DEFAULT_K = 5
DECAY = 0.9  # weight of the past per step: an estimate reflects roughly the last 10 steps
PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 4.0  # optimistic enough to try drafting before anything is measured
PROBE_EVERY = 8
REMEASURE_EVERY = 16  # batch steps (per load bucket) between re-measurements of k_start (LoadAwareLookahead)


def check_k(k: int) -> int:
    if not isinstance(k, int) or not K_MIN <= k <= K_MAX:
        raise LookaheadError(f"lookahead K must be an integer in [{K_MIN}, {K_MAX}], got {k!r}")
    return k


@dataclass
class DynamicLookahead:
    k_max: int = K_MAX
    k_start: int = DEFAULT_K
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    draft_step_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)  # tokens verified -> decayed seconds
    plain_streak: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached

    def observe(self, *, drafted: int, accepted: int, reached: int, draft_s: float, verify_s: float) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.reached = DECAY * self.reached + reached
        if drafted:
            per_step = draft_s / drafted
            old_step = self.draft_step_s
            self.draft_step_s = per_step if old_step is None else DECAY * old_step + (1 - DECAY) * per_step
        self.plain_streak = 0 if drafted else self.plain_streak + 1
        n = drafted + 1
        old = self.verify_s.get(n)
        self.verify_s[n] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s

    def verify_cost(self, n_tokens: int) -> float:
        return verify_cost(self.verify_s, n_tokens)  # the shadow projection's interpolation too

    def choose(self) -> int:
        k_start = min(self.k_start, self.k_max)
        if self.draft_step_s is None or not self.verify_s:
            return k_start
        if len(self.verify_s) < 2:  # one step size seen: try another to learn how verify cost grows with K
            return max(1, k_start // 2)
        if 1 not in self.verify_s:
            return 0  # measure one plain step: the cost speculation has to beat
        if self.plain_streak >= PROBE_EVERY:
            return 1  # probe: has the draft started agreeing again?
        alpha = min(self.alpha, 0.999)
        best_k, best_rate = 0, 1.0 / self.verify_cost(1)
        for k in range(1, self.k_max + 1):
            rate = expected_tokens(alpha=min(alpha, 1.0), k=k) / (self.verify_cost(k + 1) + k * self.draft_step_s)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k


def load_bucket(batch_size: int) -> int:
    """Batch sizes that share cost measurements: 1, 2, 4, 8, ... (the next power of two)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class LoadAwareLookahead:
    """Dynamic K for a batch of slots (speculation.engine.batch): the goodput of speculation at this load.

    A step over B slots with K drafts costs verify(B rows x (K + 1) tokens) + K batched draft steps and commits
    E[N] tokens per slot, so the K that maximises E[N] / (verify + K * draft) at the current batch size wins,
    with K = 0 (plain batched decoding) among the candidates: as the batch grows the target pass stops being
    memory-bound, verifying K + 1 tokens per slot costs nearly K + 1 times one, and speculation stops paying
    (vLLM RFC #4565, SGLang PR #13376, Nightjar arXiv 2512.22420). Costs are measured per batch-size bucket
    (a DynamicLookahead each); the acceptance is shared by all buckets (it does not depend on the load). Every
    ``REMEASURE_EVERY`` steps of a bucket one step drafts ``k_start`` again, so a cost measured at a noisy moment
    does not keep a K from ever being tried again.
    """

    k_start: int = DEFAULT_K
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    by_load: dict[int, DynamicLookahead] = field(default_factory=dict)  # load bucket -> its measured costs
    steps: dict[int, int] = field(default_factory=dict)  # load bucket -> steps chosen there

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached if self.reached > 0 else PRIOR_ALPHA

    def _costs(self, batch_size: int) -> DynamicLookahead:
        bucket = load_bucket(batch_size)
        if bucket not in self.by_load:
            self.by_load[bucket] = DynamicLookahead(k_start=self.k_start)
        return self.by_load[bucket]

    def choose(self, batch_size: int, *, k_max: int) -> int:
        bucket = load_bucket(batch_size)
        costs = self._costs(batch_size)
        costs.k_max, costs.k_start = k_max, min(self.k_start, k_max)
        costs.accepted, costs.reached = self.alpha, 1.0
        self.steps[bucket] = self.steps.get(bucket, 0) + 1
        if self.steps[bucket] % REMEASURE_EVERY == 0:
            return costs.k_start
        return costs.choose()

    def observe(
        self,
        *,
        batch_size: int,
        drafted: int,
        accepted: int,
        reached: int,
        draft_s: float,
        verify_s: float,
        catch_up: bool = False,
    ) -> None:
        """One batch step: drafted = draft tokens per row (the verify width - 1); accepted / reached summed over
        the slots; draft_s / verify_s the step's wall time. catch_up: the drafting also fed the draft the tokens
        that plain steps committed, so draft_s is not a draft step's cost (the last estimate stands)."""
        costs = self._costs(batch_size)
        if catch_up and costs.draft_step_s is not None:
            draft_s = costs.draft_step_s * drafted
        costs.observe(drafted=drafted, accepted=0, reached=0, draft_s=draft_s, verify_s=verify_s)
        self.accepted = DECAY * self.accepted + accepted
        self.reached = DECAY * self.reached + reached
