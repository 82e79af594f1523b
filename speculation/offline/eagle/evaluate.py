"""Greedy acceptance of a head on held-out sequences, by exact replay.

The held-out sequences are the target's own greedy continuations, with its features at every position, so
greedy speculative decoding can be replayed without running the target: at each verification step the
head drafts K tokens from the true features up to the committed length, the accepted run is the prefix
that matches the target's continuation, and the target contributes one more token (recovered or bonus).
This is the number of tokens each target pass would commit, exactly (up to near-ties of the target's top
two logits, where batched and incremental float32 sums can differ). A pooled figure over a few dozen held-out
sequences is noisy: `bootstrap_interval` says how much (95 %, resampling whole sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculation.engine.eagle import EagleDrafter, EagleHead, greedy_choice
from speculation.offline.eagle.collect import Sequences

BOOTSTRAP_RESAMPLES = 200  # enough for a 95 % percentile interval to two decimals


@dataclass
class ReplayStats:
    """accepted / reached per draft position; mean accepted length counts the target's token (EAGLE's tau)."""

    k: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.position_reached = self.position_reached or [0] * self.k
        self.position_accepted = self.position_accepted or [0] * self.k

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached, strict=True)]

    @property
    def alpha(self) -> float:
        """Mean acceptance probability per draft position (all positions reached, pooled)."""
        reached = sum(self.position_reached)
        return sum(self.position_accepted) / reached if reached else 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (vLLM's "draft acceptance rate"; not alpha)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    def merge(self, other: ReplayStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.committed += other.committed
        for i in range(self.k):
            self.position_reached[i] += other.position_reached[i]
            self.position_accepted[i] += other.position_accepted[i]

    def as_dict(self) -> dict:
        return {
            "k": self.k,
            "alpha": round(self.alpha, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_len": round(self.mean_accepted_len, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "steps": self.steps,
        }


@torch.no_grad()
def replay_sequence(drafter: EagleDrafter, tokens: torch.Tensor, features: torch.Tensor, prompt_len: int, k: int):
    stats = ReplayStats(k)
    total = tokens.numel()
    if prompt_len >= total:
        return stats
    drafter.reset()
    drafter.observe(features[:prompt_len], tokens[1 : prompt_len + 1])
    n = prompt_len  # tokens[: n + 1] are committed; the target has processed tokens[:n]
    while n + 1 < total:
        kk = min(k, total - 1 - n)
        drafts, _ = drafter.draft(kk, greedy_choice)
        matches = (drafts == tokens[n + 1 : n + 1 + kk]).long()
        accepted = int(matches.cumprod(0).sum())
        stats.steps += 1
        stats.drafted += kk
        stats.accepted += accepted
        for i in range(min(accepted + 1, kk)):
            stats.position_reached[i] += 1
            stats.position_accepted[i] += int(i < accepted)
        new_n = min(n + accepted + 1, total - 1)
        stats.committed += new_n - n
        drafter.observe(features[n:new_n], tokens[n + 1 : new_n + 1])
        n = new_n
    return stats


def replay(
    head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor, data: Sequences, *, k: int = 5
) -> tuple[ReplayStats, dict[str, ReplayStats]]:
    """Pooled and per-category greedy replay stats of the head over every sequence in data."""
    pooled = ReplayStats(k)
    by_category: dict[str, ReplayStats] = {}
    for category, stats in replay_each(head, embed, lm_head, data, k=k):
        pooled.merge(stats)
        by_category.setdefault(category, ReplayStats(k)).merge(stats)
    return pooled, by_category


def replay_each(
    head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor, data: Sequences, *, k: int = 5
) -> list[tuple[str, ReplayStats]]:
    """(category, greedy replay stats) of every sequence in data, in order."""
    head.eval()
    max_len = max(t.numel() for t in data.tokens) + k + 1
    drafter = EagleDrafter(head, embed, lm_head, max_len=max_len)
    return [
        (category, replay_sequence(drafter, tokens.to(embed.device), features.to(embed.device), prompt_len, k))
        for tokens, features, prompt_len, category in zip(
            data.tokens, data.features, data.prompt_lens, data.categories, strict=True
        )
    ]


def bootstrap_interval(
    sequences: list[ReplayStats], metric: str, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of a pooled metric ("alpha", "mean_accepted_len").

    Sequences are resampled whole: positions inside one sequence are far from independent (a head that
    follows a repetition loop is right at every position of it), so a binomial interval over positions
    would be much too narrow.
    """
    if not sequences:
        return (0.0, 0.0)
    generator = torch.Generator().manual_seed(seed)
    values = []
    for _ in range(resamples):
        pooled = ReplayStats(sequences[0].k)
        for i in torch.randint(0, len(sequences), (len(sequences),), generator=generator).tolist():
            pooled.merge(sequences[i])
        values.append(getattr(pooled, metric))
    values.sort()
    low, high = values[int(0.025 * (resamples - 1))], values[int(0.975 * (resamples - 1))]
    return (round(low, 4), round(high, 4))
