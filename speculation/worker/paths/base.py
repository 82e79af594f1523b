"""One verification step's committed tokens, as a caller outside the engine's loop reports them (the batch loop,
speculation.worker.batching); speculation.worker.generation counts them with the engine's SpecStats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommittedBatch:
    """Tokens committed by one target verification: accepted draft tokens + one target token."""

    ids: list[int]
    drafted: int
    accepted: int
    finished: bool  # an end-of-sequence token was committed
    looked_up: bool = False  # a hybrid's lookup drafted (no draft-model step)
