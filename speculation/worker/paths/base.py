"""The interface every worker-side verification path implements, and the stats they keep."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CommittedBatch:
    """Tokens committed by one target verification: accepted draft tokens + one target token."""

    ids: list[int]
    drafted: int
    accepted: int
    finished: bool  # an end-of-sequence token was committed


@dataclass
class SpecRunStats:
    """Counts of one generation (the names of the papers: drafted, accepted; passes = verifications)."""

    k: int
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    output_tokens: int = 0
    compared: int = 0  # draft tokens checked against the target: accepted + the first rejection of each step
    accepted_at: list[int] = field(default_factory=list)  # [i]: steps whose draft token i was accepted
    drafted_at: list[int] = field(default_factory=list)  # [i]: steps that drafted a token at position i
    accepted_len_hist: list[int] = field(default_factory=list)  # [n]: steps committing n accepted drafts

    def add(self, batch: CommittedBatch) -> None:
        self.passes += 1
        self.drafted += batch.drafted
        self.accepted += batch.accepted
        self.compared += batch.accepted + (1 if batch.accepted < batch.drafted else 0)
        self.output_tokens += len(batch.ids)
        width = max(self.k, batch.drafted)
        for counts in (self.accepted_at, self.drafted_at):
            counts.extend([0] * (width - len(counts)))
        for i in range(batch.drafted):
            self.drafted_at[i] += 1
        for i in range(batch.accepted):
            self.accepted_at[i] += 1
        self.accepted_len_hist.extend([0] * (width + 1 - len(self.accepted_len_hist)))
        self.accepted_len_hist[batch.accepted] += 1

    def as_record(self) -> dict:
        """The StageRecord fields (acceptance_rate = accepted/drafted; mean_accepted_len includes the bonus)."""
        per_position = [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]
        return {
            "k": self.k,
            "target_passes": self.passes,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "per_position_acceptance": per_position,
            "accepted_length_hist": self.accepted_len_hist,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            # P(a draft token is accepted | it was checked): the alpha of Leviathan et al. for greedy.
            "alpha": self.accepted / self.compared if self.compared else None,
            "mean_accepted_len": self.output_tokens / self.passes if self.passes else None,
        }
