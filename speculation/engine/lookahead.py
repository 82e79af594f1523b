"""Choosing K, the lookahead: fixed, or the K that maximises expected tokens per unit time.

Dynamic K (ANCHORS section 1): with per-position acceptance alpha, a step with K drafts commits
E[N] = (1 - alpha^(K+1)) / (1 - alpha) tokens and costs verify(K) + K * draft_step. alpha is a decayed
estimate from the accepted counts (accepted / positions reached); the costs are decayed averages of
measured wall time. verify(K) is fitted as a + b * (K + 1) from the step sizes seen so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from speculation.engine.errors import LookaheadError

K_MIN, K_MAX = 1, 16
DEFAULT_K = 5
DECAY = 0.9  # weight of the past per step: an estimate reflects roughly the last 10 steps
PRIOR_ALPHA, PRIOR_WEIGHT = 0.6, 4.0  # optimistic enough to try drafting before anything is measured


def check_k(k: int) -> int:
    if not isinstance(k, int) or not K_MIN <= k <= K_MAX:
        raise LookaheadError(f"lookahead K must be an integer in [{K_MIN}, {K_MAX}], got {k!r}")
    return k


def expected_tokens(alpha: float, k: int) -> float:
    """E[N] for i.i.d. acceptance alpha and k drafts (bonus included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class DynamicLookahead:
    k_max: int = K_MAX
    k_start: int = DEFAULT_K
    accepted: float = PRIOR_ALPHA * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    draft_step_s: float | None = None
    verify_s: dict[int, float] = field(default_factory=dict)  # tokens verified -> decayed seconds

    @property
    def alpha(self) -> float:
        return self.accepted / self.reached

    def observe(self, *, drafted: int, accepted: int, reached: int, draft_s: float, verify_s: float) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.reached = DECAY * self.reached + reached
        if drafted:
            per_step = draft_s / drafted
            self.draft_step_s = (
                per_step if self.draft_step_s is None else DECAY * self.draft_step_s + (1 - DECAY) * per_step
            )
        n = drafted + 1
        old = self.verify_s.get(n)
        self.verify_s[n] = verify_s if old is None else DECAY * old + (1 - DECAY) * verify_s

    def verify_cost(self, n_tokens: int) -> float:
        points = sorted(self.verify_s.items())
        if len(points) == 1:
            return points[0][1]
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var)
        return max(1e-9, mean_y + slope * (n_tokens - mean_x))

    def choose(self) -> int:
        if self.draft_step_s is None or not self.verify_s:
            return min(self.k_start, self.k_max)
        if len(self.verify_s) < 2:  # one step size seen: try another to learn how verify cost grows with K
            return max(1, min(self.k_start, self.k_max) // 2)
        alpha = min(self.alpha, 0.999)
        best_k, best_rate = 1, -1.0
        for k in range(1, self.k_max + 1):
            rate = expected_tokens(alpha, k) / (self.verify_cost(k + 1) + k * self.draft_step_s)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k
