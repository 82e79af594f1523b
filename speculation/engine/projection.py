"""What prod would give, from measured acceptance and measured costs (ANCHORS section 1).

alpha = per-position acceptance probability, c = cost of one draft step / one target step,
v = cost of verifying K+1 tokens / one target step.
E[N] = (1 - alpha^(K+1)) / (1 - alpha) tokens per verification step (bonus token included), and the
wall-time multiplier is S = E[N] / (v + K c) (Leviathan et al. 2023, Theorem 3.8 when v = 1).
Pure functions, standard library only: the engine's lookahead controller, the shadow projection, the pages and the
API share this one formula. StepCosts holds measured wall times (speculation.engine.costs times them): c = draft
step / target step and v(K) = verify(K + 1 tokens) / target step, verify cost interpolated between the sizes
measured exactly as the lookahead controller does (`verify_cost`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

MAX_PROJECTED_K = 8


@dataclass(frozen=True)
class ProjectionPoint:
    k: int
    expected_tokens: float  # E[N], tokens per verification step, bonus included
    multiplier: float  # S = E[N] / (v + K c)
    best: bool = False


def expected_tokens(*, alpha: float, k: int) -> float:
    """E[N] = (1 - alpha^(K+1)) / (1 - alpha); the limit K + 1 at alpha = 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"K must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def multiplier(*, alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """S = E[N] / (v + K c): the tok/s multiplier over plain decoding."""
    if c < 0 or v <= 0:
        raise ValueError(f"costs must be c >= 0 and v > 0, got c={c}, v={v}")
    return expected_tokens(alpha=alpha, k=k) / (v + k * c)


def project(
    *, alpha: float, c: float, v: float | Callable[[int], float] = 1.0, k_max: int = MAX_PROJECTED_K
) -> list[ProjectionPoint]:
    """The curve for K = 1..k_max with the best K marked (the smallest K on a tie); v a number or v(K)."""
    v_of = v if callable(v) else (lambda k: v)
    points = [
        ProjectionPoint(
            k=k,
            expected_tokens=expected_tokens(alpha=alpha, k=k),
            multiplier=multiplier(alpha=alpha, k=k, c=c, v=v_of(k)),
        )
        for k in range(1, k_max + 1)
    ]
    best_k = max(points, key=lambda p: (p.multiplier, -p.k)).k
    return [ProjectionPoint(p.k, p.expected_tokens, p.multiplier, best=p.k == best_k) for p in points]


def non_decreasing(costs: Mapping[int, float]) -> dict[int, float]:
    """The closest non-decreasing costs by size (pool adjacent violators, least squares): verifying more tokens
    never costs less, so a size measured cheaper than a smaller one is noise, averaged with its neighbours."""
    blocks: list[list[float]] = []  # [mean, count] per pooled run of sizes
    for n in sorted(costs):
        blocks.append([costs[n], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (mean_b, count_b), (mean_a, count_a) = blocks.pop(), blocks.pop()
            blocks.append([(mean_a * count_a + mean_b * count_b) / (count_a + count_b), count_a + count_b])
    pooled = [mean for mean, count in blocks for _ in range(int(count))]
    return dict(zip(sorted(costs), pooled, strict=True))


def verify_cost(verify_s: Mapping[int, float], n_tokens: float) -> float:
    """The cost of verifying n_tokens from the sizes measured: the measurement itself, else interpolated between
    the nearest measured sizes, else extended from the nearest one along the measured slope (never falling).
    The lookahead controller and the shadow projection share it."""
    if not verify_s:
        raise ValueError("no verification cost measured")
    if n_tokens in verify_s:
        return verify_s[n_tokens]
    below = [n for n in verify_s if n < n_tokens]
    above = [n for n in verify_s if n > n_tokens]
    if below and above:  # interpolate between the nearest measured sizes
        lo, hi = max(below), min(above)
        w = (n_tokens - lo) / (hi - lo)
        return (1 - w) * verify_s[lo] + w * verify_s[hi]
    nearest = max(below) if below else min(above)
    points = sorted(verify_s)
    if len(points) < 2:
        return verify_s[nearest]
    slope = max(0.0, (verify_s[points[-1]] - verify_s[points[0]]) / (points[-1] - points[0]))
    return verify_s[nearest] + slope * (n_tokens - nearest)


@dataclass(frozen=True)
class StepCosts:
    """Measured wall times on the endpoint's node class: one plain step of the target as prod's baseline runs it
    (the server's decode step), one draft step, and a verification of n tokens on prod's path."""

    target_step_s: float
    draft_step_s: float
    verify_s: Mapping[int, float]  # tokens verified (K + 1) -> seconds

    def __post_init__(self) -> None:
        if self.target_step_s <= 0 or self.draft_step_s < 0 or not self.verify_s:
            raise ValueError(f"costs need a target step > 0, a draft step >= 0 and verify sizes, got {self}")

    @property
    def c(self) -> float:
        return self.draft_step_s / self.target_step_s

    def v(self, k: float) -> float:
        """Verifying K + 1 tokens on prod's path, in target steps (K may be a mean number of drafts)."""
        return verify_cost(self.verify_s, k + 1) / self.target_step_s

    def multiplier(
        self, *, tokens_per_step: float, k: float, verified: float | None = None, draft_steps: float | None = None
    ) -> float:
        """S = E[N] / (v(K) + K c) with E[N] the tokens a verification step commits. verified: the drafts one
        verification checks when that is not K (a draft tree: all its nodes, K its depth of drafting steps).
        draft_steps: the model steps per verification when that is not K (a hybrid: its lookup's drafts cost none)."""
        steps = k if draft_steps is None else draft_steps
        return tokens_per_step / (self.v(k if verified is None else verified) + steps * self.c)

    def curve(self, *, alpha: float, k_max: int = MAX_PROJECTED_K) -> list[ProjectionPoint]:
        """project() with v measured per K."""
        return project(alpha=alpha, c=self.c, v=self.v, k_max=k_max)
