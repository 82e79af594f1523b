"""Speculation statistics of one generation (or of a replay), as a plain dataclass.

Two acceptance figures, named apart because engines mix them up (see ANCHORS section 1):
- ``acceptance_rate`` = accepted / drafted (vLLM's "draft acceptance rate"; equals (E[N] - 1) / K).
- ``alpha`` = per-position acceptance: accepted / positions reached (a position is reached when every
  earlier draft token of its step was accepted), the i.i.d. alpha of Leviathan et al.
``mean_accepted_len`` = tokens committed per verification step, bonus/recovered token included (E[N], tau).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0  # verification steps that carried at least one draft token
    drafted_tokens: int = 0
    looked_up_tokens: int = 0  # of drafted_tokens, those a hybrid took from its lookup (no model step)
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps whose draft i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps that drafted a token at i
    reached_per_position: list[int] = field(default_factory=list)  # [i]: steps where draft i was judged
    accepted_length_histogram: list[int] = field(default_factory=list)  # [n]: steps with n accepted drafts
    target_passes: int = 0  # target forward passes after the prefill (spec steps + plain steps)
    output_tokens: int = 0
    elapsed_s: float = 0.0
    prefill_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt positions taken from the prefix cache instead of prefilled (target)
    draft_s: float = 0.0
    verify_s: float = 0.0

    def record_step(self, *, drafted: int, accepted: int, reached: int, looked_up: bool = False) -> None:
        self.target_passes += 1
        if drafted == 0:
            return
        if looked_up:
            self.looked_up_tokens += drafted
        self.drafts += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        _grow(self.accepted_per_position, drafted)
        _grow(self.drafted_per_position, drafted)
        _grow(self.reached_per_position, drafted)
        _grow(self.accepted_length_histogram, drafted + 1)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(reached):
            self.reached_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        self.accepted_length_histogram[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def alpha(self) -> float:
        reached = sum(self.reached_per_position)
        return sum(self.accepted_per_position) / reached if reached else 0.0

    @property
    def alpha_per_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position, strict=True)]

    @property
    def mean_accepted_len(self) -> float:
        return (self.accepted_tokens + self.drafts) / self.drafts if self.drafts else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens committed per target pass after the prefill, steps that drafted nothing included: what a speed
        projection divides by the cost of the average pass (mean_accepted_len counts the drafting steps only, so
        for a lookup that finds a draft on few steps it is far above what the target's passes deliver)."""
        return 1.0 + self.accepted_tokens / self.target_passes if self.target_passes else 1.0

    @property
    def model_steps_per_pass(self) -> float:
        """Draft-model steps per target pass (drafts a lookup gave cost none): the K a projection charges c for."""
        return (self.drafted_tokens - self.looked_up_tokens) / self.target_passes if self.target_passes else 0.0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def counts(self) -> dict:
        """The timing-free part (what a replay must reproduce exactly)."""
        keys = (
            "drafts",
            "drafted_tokens",
            "looked_up_tokens",
            "accepted_tokens",
            "accepted_per_position",
            "drafted_per_position",
            "reached_per_position",
            "accepted_length_histogram",
            "target_passes",
            "output_tokens",
        )
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def combine(cls, parts: list[SpecStats]) -> SpecStats:
        """Sum several requests' stats (per-position lists are summed element-wise)."""
        total = cls()
        for part in parts:
            for name in (
                "drafts",
                "drafted_tokens",
                "looked_up_tokens",
                "accepted_tokens",
                "target_passes",
                "output_tokens",
                "elapsed_s",
                "prefill_s",
                "draft_s",
                "verify_s",
            ):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            for name in (
                "accepted_per_position",
                "drafted_per_position",
                "reached_per_position",
                "accepted_length_histogram",
            ):
                mine, theirs = getattr(total, name), getattr(part, name)
                _grow(mine, len(theirs))
                for i, value in enumerate(theirs):
                    mine[i] += value
        return total


def _grow(values: list[int], size: int) -> None:
    if len(values) < size:
        values.extend([0] * (size - len(values)))
