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

TreeLookahead also sizes the tree's WIDTH: each step it picks a shape from a small family derived from the
policy's tree (the chain, the tree with half its nodes, the tree: ``tree_family``) and a depth, by the same rule
per shape: E[N] from that shape's own decayed acceptance over (verification of its nodes + depth x its draft level
cost). On a CPU, where every verified row costs nearly its full price, the chain tends to win; where verifying more
rows is nearly free (a GPU), the wide tree does. Shapes not used for ``SHAPE_PROBE_EVERY`` steps are probed again.

Every controller has one interface (``Lookahead``): ``choose(batch_size)`` gives the next step's K and
``observe(StepReport)`` learns from the step that ran. A single request's loop (decode.generate) passes batch size 1;
the batch engine (engine/batch.py) its current batch size, which LoadAwareLookahead's costs are kept by.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from speculation.engine.errors import LookaheadError
from speculation.engine.projection import expected_tokens, non_decreasing, verify_cost
from speculation.limits import DEFAULT_K, K_MAX, K_MIN, tree_nodes_at

if TYPE_CHECKING:
    from speculation.engine.tree import TreeShape

__all__ = [
    "DEFAULT_K",
    "K_MAX",
    "K_MIN",
    "DynamicLookahead",
    "Lookahead",
    "ModeledLookahead",
    "StepReport",
    "TreeLookahead",
    "check_k",
    "expected_tokens",
]

DECAY = 0.9  # weight of the past per step: an estimate reflects roughly the last 10 steps
PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 4.0  # optimistic enough to try drafting before anything is measured
PROBE_EVERY = 8
SHAPE_PROBE_EVERY = 16  # drafting steps a tree shape goes unused before one step probes it again
REMEASURE_EVERY = 16  # batch steps (per load bucket) between re-measurements of k_start (LoadAwareLookahead)
# one step's time counts at most this many times the estimate it updates: a stall (another process on the core, a
# garbage collection) would otherwise raise a size's cost for good, since a size that looks dear is not chosen, so
# not measured again (seen on the demo: verify(5) at 16 ms beside verify(6) at 13 ms held K at 1 for 9 steps)
SPIKE = 3.0


def check_k(k: int) -> int:
    if not isinstance(k, int) or not K_MIN <= k <= K_MAX:
        raise LookaheadError(f"lookahead K must be an integer in [{K_MIN}, {K_MAX}], got {k!r}")
    return k


@dataclass(frozen=True)
class StepReport:
    """One verification step, as a controller learns from it: drafted = draft tokens per row (a tree: its depth);
    accepted / reached over the greedy rows (reached: the draft positions whose verdict was read); draft_s /
    verify_s the step's wall times; verified = the tokens the target pass checked per row when not drafted + 1 (a
    tree's nodes + 1, a hybrid's wider lookups). For a batch step: batch_size, the sampled rows' own counts, a
    hybrid's looked-up rows' (accepted, reached) greedy then sampled, and catch_up (the drafting also fed the draft
    the tokens plain steps committed, so draft_s is not a draft step's cost)."""

    drafted: int
    accepted: int
    reached: int
    draft_s: float
    verify_s: float
    verified: int = 0
    batch_size: int = 1
    catch_up: bool = False
    sampled_accepted: int = 0
    sampled_reached: int = 0
    lookup: tuple[int, int, int, int] = (0, 0, 0, 0)


class Lookahead(Protocol):
    """What the engine's step asks of its K controller. The step calls ``choose`` once per kind of slot it holds
    (greedy, then sampled), with the requests' largest K; a single request's controller (one kind, its own k_max)
    may ignore those."""

    def choose(
        self, batch_size: int = 1, *, k_max: int | None = None, sampled: bool = False, count: bool = True
    ) -> int: ...

    def observe(self, report: StepReport) -> None: ...


@dataclass
class DynamicLookahead:
    k_max: int = K_MAX
    k_start: int = DEFAULT_K
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    draft_step_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)  # tokens verified -> decayed seconds
    plain_streak: int = 0
    seen: dict[tuple, int] = field(default_factory=dict, repr=False)  # measurements per estimate (``_decayed``)

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached

    def observe(self, report: StepReport) -> None:
        """One step's counts (greedy or sampled: one request's) and wall times; the verify cost table is keyed by the
        tokens the target pass checked."""
        self.accepted = DECAY * self.accepted + report.accepted + report.sampled_accepted
        self.reached = DECAY * self.reached + report.reached + report.sampled_reached
        drafted = report.drafted
        if drafted:
            self.draft_step_s = self._decayed(("draft",), self.draft_step_s, report.draft_s / drafted)
        self.plain_streak = 0 if drafted else self.plain_streak + 1
        n = report.verified or drafted + 1
        self.verify_s[n] = self._decayed(("verify", n), self.verify_s.get(n), report.verify_s)

    def _decayed(self, key: tuple, old: float | None, new: float) -> float:
        """The estimate after one more measurement. A size's first measurement is a warm-up: on a CPU a shape's
        first forward builds its kernels and caches (measured on the demo: a fresh batch decoder's first steps at
        up to 3x the later ones, which held K at 1 for dozens of steps), so the second replaces it. After that,
        the mean of the measurements while they are fewer than 1 / (1 - DECAY), then the decayed average; a
        measurement counts at most SPIKE times the estimate. A value set without measurements counts as one."""
        warm = self.seen.get(key, None if old is None else 1)  # warm measurements behind the estimate
        if old is None or warm == 0:
            self.seen[key] = 0 if old is None else 1
            return new
        self.seen[key] = warm = warm + 1
        return old + max(1 - DECAY, 1.0 / warm) * (min(new, SPIKE * old) - old)

    def warm(self, n_tokens: int) -> bool:
        """Whether verifying n tokens has a measurement past its warm-up (or a value set without one)."""
        return n_tokens in self.verify_s and self.seen.get(("verify", n_tokens)) != 0

    def verify_cost(self, n_tokens: int) -> float:
        """The shadow projection's interpolation over the measured sizes, pooled to be non-decreasing (verifying
        more tokens never costs less: a size that looks dearer than a larger one is noise)."""
        return verify_cost(non_decreasing(self.verify_s), n_tokens)

    def _cold(self) -> list[int]:
        """Sizes measured once (their warm-up) that a K within k_max can measure again (a hybrid's lookups verify
        wider than its draft's K: those sizes are data, never a reason to draft wider)."""
        return [n for n in self.verify_s if not self.warm(n) and n <= self.k_max + 1]

    def exploring(self) -> bool:
        """Whether choose() is measuring costs rather than deciding on them (a step's width must then be its K + 1)."""
        return self.draft_step_s is None or len(self.verify_s) < 2 or 1 not in self.verify_s or bool(self._cold())

    def choose(self, batch_size: int = 1, **_: object) -> int:
        """The next step's K (a single request's controller: its costs are those of batch size 1)."""
        k_start = min(self.k_start, self.k_max)
        if self.draft_step_s is None or not self.verify_s:
            return k_start
        cold = self._cold()
        if cold:  # a size measured once, its warm-up: measure it again before deciding on it
            return min(min(cold) - 1, self.k_max)
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


@dataclass
class ModeledLookahead(DynamicLookahead):
    """Dynamic K over fixed costs (a calibration's), for a replay: it chooses each step's K by DynamicLookahead's
    rule, learns the acceptance from the replayed steps, ignores their wall times (a replay's verification is a
    lookup, not the target) and adds up what the chosen steps would cost (``modeled_s``: verify(K + 1) + K draft
    steps each), so that a shadow projection is over the K prod's controller would choose, not a fixed one."""

    modeled_s: float = 0.0
    steps: int = 0

    @classmethod
    def over(
        cls, *, verify_s: dict[int, float], draft_step_s: float, k: int, accepted: float, reached: float
    ) -> ModeledLookahead:
        """A controller with these costs (seconds) and acceptance counts (e.g. carried over from earlier requests)."""
        return cls(
            k_max=k, k_start=k, accepted=accepted, reached=reached, draft_step_s=draft_step_s, verify_s=dict(verify_s)
        )

    def observe(self, report: StepReport) -> None:
        drafted = report.drafted
        self.accepted = DECAY * self.accepted + report.accepted + report.sampled_accepted
        self.reached = DECAY * self.reached + report.reached + report.sampled_reached
        self.plain_streak = 0 if drafted else self.plain_streak + 1
        self.modeled_s += self.verify_cost(report.verified or drafted + 1) + drafted * (self.draft_step_s or 0.0)
        self.steps += 1


def tree_family(tree: TreeShape) -> tuple[TreeShape, ...]:
    """The shapes TreeLookahead chooses among, narrowest first: the chain (top_k 1, one node per level), the
    policy's tree cut to half its nodes, and the policy's tree (a policy chain of top_k 1: the chain only)."""
    shapes = [replace(tree, top_k=1, nodes=tree.depth)]
    if tree.top_k > 1:
        shapes += [replace(tree, nodes=tree.nodes // 2)] if tree.nodes // 2 > 1 else []
        shapes.append(tree)
    return tuple(dict.fromkeys(shapes))  # distinct, in order


def shape_label(shape: TreeShape) -> str:
    """A family member's name in records and the benchmark (its depth is chosen per step, so not in it)."""
    return "chain" if shape.top_k == 1 else f"k{shape.top_k}-n{shape.nodes}"


@dataclass
class ShapeArm:
    """One tree shape's decayed acceptance (accepted drafts per position reached, as DynamicLookahead's alpha)."""

    shape: TreeShape
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    idle: int = 0  # drafting steps since it was last used
    used: int = 0  # drafting steps it was used for

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached

    def nodes(self, k: int) -> int:
        """Draft nodes one verification checks at depth k (EagleProposer cuts the shape to depth min(depth, k))."""
        return tree_nodes_at(self.shape.top_k, self.shape.depth, self.shape.nodes, k)


@dataclass
class TreeLookahead(DynamicLookahead):
    """Dynamic K and tree shape for an EAGLE draft-tree proposer: ``choose`` returns the depth K (0: a plain step)
    and leaves the step's shape in ``shape``; pass it to the proposer (the decode loop does).

    A step with shape s at depth k commits E[N](alpha_s, k) and costs verify(nodes_s(k) + 1 tokens) + drafting k
    levels at s's width (the head feeds top_k rows per level). Drafting time is kept per width and depth (it has a
    fixed part, feeding the head the step's accepted tokens, so a short step's time per level is no level cost) and
    read as the verify table is (``verify_cost``: measured, interpolated, extended); a width not measured yet
    borrows the cheapest measured one. The (shape, K) with the most expected tokens per second wins, plain decoding
    among the candidates; a shape never used is tried first, then one unused for SHAPE_PROBE_EVERY drafting steps is
    probed, so a shape whose acceptance or cost has changed is not ruled out for good.
    """

    arms: list[ShapeArm] = field(default_factory=list)
    drafting_s: dict[int, dict[int, float]] = field(default_factory=dict)  # top_k -> depth -> decayed seconds
    shape: TreeShape | None = None  # the shape of the step choose() sized (None: a plain step)
    _arm: ShapeArm | None = None

    @classmethod
    def for_tree(cls, tree: TreeShape, *, k_max: int = K_MAX, k_start: int = DEFAULT_K) -> TreeLookahead:
        return cls(k_max=k_max, k_start=k_start, arms=[ShapeArm(shape) for shape in tree_family(tree)])

    @property
    def used(self) -> dict[str, int]:
        """Drafting steps per shape (labels as ``shape_label``), over the controller's life."""
        return {shape_label(arm.shape): arm.used for arm in self.arms}

    def choose(self, batch_size: int = 1, **_: object) -> int:
        k_start = min(self.k_start, self.k_max)
        if not self.drafting_s or not self.verify_s:  # nothing measured: the policy's tree at the policy's depth
            return self._pick(self.arms[-1], k_start)
        if 1 not in self.verify_s:
            return self._pick(None, 0)  # one plain step: the cost speculation has to beat
        rated = [(self._rate(arm, k), arm, k) for arm in self.arms for k in range(1, self.k_max + 1)]
        probe = next((arm for arm in self.arms if not arm.used), None)
        probe = probe or max(self.arms, key=lambda arm: arm.idle)
        if probe.idle >= SHAPE_PROBE_EVERY or not probe.used:
            _, _, k = max((entry for entry in rated if entry[1] is probe), key=lambda entry: entry[0])
            return self._pick(probe, k)  # the probed shape at its best depth
        rate, arm, k = max(rated, key=lambda entry: entry[0])
        if self.plain_streak >= PROBE_EVERY:
            return self._pick(arm, 1)  # probe: has the draft started agreeing again?
        return self._pick(arm, k) if rate > 1.0 / self.verify_cost(1) else self._pick(None, 0)

    def _rate(self, arm: ShapeArm, k: int) -> float:
        alpha = min(arm.alpha, 0.999)
        return expected_tokens(alpha=alpha, k=k) / (self.verify_cost(arm.nodes(k) + 1) + self.drafting_cost(arm, k))

    def drafting_cost(self, arm: ShapeArm, k: int) -> float:
        """Seconds to draft k levels at the arm's width (one depth measured: proportional to the depth)."""
        width = arm.shape.top_k
        tables = [self.drafting_s[width]] if width in self.drafting_s else list(self.drafting_s.values())
        return min(_drafting_time(table, k) for table in tables)

    def _pick(self, arm: ShapeArm | None, k: int) -> int:
        self._arm, self.shape = arm, arm.shape if arm is not None else None
        return k

    def observe(self, report: StepReport) -> None:
        super().observe(report)
        drafted, arm = report.drafted, self._arm
        if not drafted or arm is None:
            return
        for other in self.arms:
            other.idle += 1
        arm.idle, arm.used = 0, arm.used + 1
        arm.accepted = DECAY * arm.accepted + report.accepted + report.sampled_accepted
        arm.reached = DECAY * arm.reached + report.reached + report.sampled_reached
        table = self.drafting_s.setdefault(arm.shape.top_k, {})
        table[drafted] = self._decayed(("drafting", arm.shape.top_k, drafted), table.get(drafted), report.draft_s)


def _drafting_time(table: dict[int, float], depth: int) -> float:
    """Drafting time at a depth from one width's measured depths: read as the verify table is (interpolated,
    extended along the measured slope); with one depth measured, proportional to the depth."""
    if len(table) == 1:
        ((measured, seconds),) = table.items()
        return seconds * depth / measured
    return verify_cost(table, depth)


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

    Greedy and sampled slots keep apart acceptance estimates (``alpha``, ``sampled_alpha``): a sampled draft token
    is kept with probability sum min(p, q) of the processed distributions, not when it is the argmax, and the two
    differ (on the demo pair demo-v10 at temperature 0.7 sampled speculation at one stream ran below K = 0 while the
    shared estimate, mostly greedy, chose K = 2-5). ``choose(..., sampled=True)`` sizes the sampled slots' K.

    A hybrid's lookups (suffix decoding with a draft model's fallback) have acceptance estimates of their own and
    cost no draft step: ``choose_lookup`` sizes them over the same measured verify costs (a lookup draft of 8 is
    verified at 9 tokens per row: cheap at one slot, as dear as 9 plain steps once the batch is compute-bound).
    """

    k_start: int = DEFAULT_K
    k_max: int = K_MAX  # choose()'s cap where the caller gives none
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    sampled_accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    sampled_reached: float = PRIOR_WEIGHT
    lookup_accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    lookup_reached: float = PRIOR_WEIGHT
    sampled_lookup_accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    sampled_lookup_reached: float = PRIOR_WEIGHT
    by_load: dict[int, DynamicLookahead] = field(default_factory=dict)  # load bucket -> its measured costs
    steps: dict[int, int] = field(default_factory=dict)  # load bucket -> steps chosen there

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached if self.reached > 0 else PRIOR_ALPHA

    @property
    def sampled_alpha(self) -> float:
        return self.sampled_accepted / self.sampled_reached if self.sampled_reached > 0 else PRIOR_ALPHA

    def _costs(self, batch_size: int) -> DynamicLookahead:
        bucket = load_bucket(batch_size)
        if bucket not in self.by_load:
            self.by_load[bucket] = DynamicLookahead(k_start=self.k_start)
        return self.by_load[bucket]

    def seed(self, batch_size: int, *, verify_s: Mapping[int, float], draft_step_s: float) -> bool:
        """Start the batch size's bucket from costs measured elsewhere (the worker's stored calibration of this
        path, timed on the same decoder's steps) rather than from its learning steps; each counts as one
        measurement, which this decoder's own steps then refine. False when the bucket has measurements already."""
        bucket = load_bucket(batch_size)
        if bucket in self.by_load or not verify_s:
            return False
        self.by_load[bucket] = DynamicLookahead(
            k_start=self.k_start, draft_step_s=draft_step_s, verify_s=dict(verify_s)
        )
        return True

    def choose_lookup(self, batch_size: int, *, k_max: int, sampled: bool = False, model_k: int = 0) -> int:
        """How far a hybrid's lookup may draft this step: the K in 0..k_max with the most tokens per second of
        verification at the lookups' own acceptance (no draft step), over this load's measured verify costs, and
        never below model_k (the model's K this step: its rows verify that wide anyway, so a lookup as long costs
        nothing more). model_k while the model's controller measures its sizes at this load (a wider lookup would
        widen the step it measures); k_max on the steps that re-measure k_start."""
        bucket = load_bucket(batch_size)
        costs = self._costs(batch_size)
        if self.steps.get(bucket, 0) % REMEASURE_EVERY == 0:
            return k_max
        if costs.exploring():
            return min(model_k, k_max)
        accepted, reached = (
            (self.sampled_lookup_accepted, self.sampled_lookup_reached)
            if sampled
            else (self.lookup_accepted, self.lookup_reached)
        )
        alpha = min(accepted / reached if reached > 0 else PRIOR_ALPHA, 0.999)
        rates = [expected_tokens(alpha=alpha, k=k) / costs.verify_cost(k + 1) for k in range(k_max + 1)]
        return max(min(model_k, k_max), max(range(k_max + 1), key=lambda k: (rates[k], -k)))

    def choose(
        self, batch_size: int = 1, *, k_max: int | None = None, sampled: bool = False, count: bool = True
    ) -> int:
        """The K for this step's greedy slots (sampled: its sampled slots, by their own acceptance), at most k_max
        (the requests' K). count: this call counts the step (once per step: a second call for the other kind
        passes False)."""
        k_max = self.k_max if k_max is None else k_max
        bucket = load_bucket(batch_size)
        costs = self._costs(batch_size)
        costs.k_max, costs.k_start = k_max, min(self.k_start, k_max)
        costs.accepted, costs.reached = (self.sampled_alpha if sampled else self.alpha), 1.0
        if count:
            self.steps[bucket] = self.steps.get(bucket, 0) + 1
        if self.steps.get(bucket, 0) % REMEASURE_EVERY == 0:
            return costs.k_start
        return costs.choose()

    def observe(self, report: StepReport) -> None:
        """One batch step (StepReport): the load bucket's costs learn its wall times, the shared estimates its
        greedy, sampled and looked-up rows' acceptance (a hybrid's other rows count the model's drafts only)."""
        costs = self._costs(report.batch_size)
        draft_s = report.draft_s
        if report.catch_up and costs.draft_step_s is not None:
            draft_s = costs.draft_step_s * report.drafted
        costs.observe(replace(report, accepted=0, reached=0, sampled_accepted=0, sampled_reached=0, draft_s=draft_s))
        self.accepted = DECAY * self.accepted + report.accepted
        self.reached = DECAY * self.reached + report.reached
        self.sampled_accepted = DECAY * self.sampled_accepted + report.sampled_accepted
        self.sampled_reached = DECAY * self.sampled_reached + report.sampled_reached
        lookup = report.lookup
        if any(lookup):
            self.lookup_accepted = DECAY * self.lookup_accepted + lookup[0]
            self.lookup_reached = DECAY * self.lookup_reached + lookup[1]
            self.sampled_lookup_accepted = DECAY * self.sampled_lookup_accepted + lookup[2]
            self.sampled_lookup_reached = DECAY * self.sampled_lookup_reached + lookup[3]
