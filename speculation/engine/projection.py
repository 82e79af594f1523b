"""What prod would give, from measured acceptance and measured costs (ANCHORS section 1).

alpha = per-position acceptance probability, c = cost of one draft step / one target step,
v = cost of verifying K+1 tokens / one target step.
E[N] = (1 - alpha^(K+1)) / (1 - alpha) tokens per verification step (bonus token included), and the
wall-time multiplier is S = E[N] / (v + K c) (Leviathan et al. 2023, Theorem 3.8 when v = 1).
Pure functions, standard library only: the engine's lookahead controller, the shadow projection, the pages and the
API share this one formula.
"""

from __future__ import annotations

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


def project(*, alpha: float, c: float, v: float = 1.0, k_max: int = MAX_PROJECTED_K) -> list[ProjectionPoint]:
    """The curve for K = 1..k_max with the best K marked (the smallest K on a tie)."""
    points = [
        ProjectionPoint(
            k=k, expected_tokens=expected_tokens(alpha=alpha, k=k), multiplier=multiplier(alpha=alpha, k=k, c=c, v=v)
        )
        for k in range(1, k_max + 1)
    ]
    best_k = max(points, key=lambda p: (p.multiplier, -p.k)).k
    return [ProjectionPoint(p.k, p.expected_tokens, p.multiplier, best=p.k == best_k) for p in points]
