"""The greedy draft -> verify loop and its exact shadow replay, written side by side so they agree.

Conventions (both functions): a step at output position i drafts k_i = min(K, max_tokens - i - 1) tokens,
so that accepted drafts + the target's token never pass max_tokens; the batch is the accepted drafts plus
the target's token (recovered on a rejection, bonus when all were accepted), cut after an end-of-sequence
token; `accepted` counts the draft tokens kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from speculation.worker.paths.base import CommittedBatch


class Proposer(Protocol):
    def propose(self, context: list[int], k: int) -> list[int]:
        """k draft tokens continuing `context` (greedy)."""


class GreedyVerifier(Protocol):
    def verify(self, context: list[int], drafts: list[int]) -> tuple[int, int]:
        """(how many leading drafts equal the target's argmax, the target's argmax after those) in ONE pass."""


def commit(drafts: Sequence[int], accepted: int, target_token: int, eos_ids: frozenset[int]) -> CommittedBatch:
    ids = [*drafts[:accepted], target_token]
    for j, token in enumerate(ids):
        if token in eos_ids:
            return CommittedBatch(ids=ids[: j + 1], drafted=len(drafts), accepted=min(accepted, j + 1), finished=True)
    return CommittedBatch(ids=ids, drafted=len(drafts), accepted=accepted, finished=False)


def step_k(k: int, max_tokens: int, produced: int) -> int:
    return max(0, min(k, max_tokens - produced - 1))


def greedy_speculate(
    *,
    proposer: Proposer,
    verifier: GreedyVerifier,
    prompt_ids: list[int],
    max_tokens: int,
    k: int,
    eos_ids: frozenset[int],
) -> Iterator[CommittedBatch]:
    committed: list[int] = []
    while len(committed) < max_tokens:
        context = prompt_ids + committed
        k_step = step_k(k, max_tokens, len(committed))
        drafts = proposer.propose(context, k_step) if k_step else []
        accepted, target_token = verifier.verify(context, drafts)
        batch = commit(drafts, accepted, target_token, eos_ids)
        committed.extend(batch.ids)
        yield batch
        if batch.finished:
            return


def replay_greedy_batches(
    *, draft_next: Sequence[int], output_ids: Sequence[int], max_tokens: int, k: int, stopped: bool = False
) -> Iterator[CommittedBatch]:
    """What greedy_speculate would have committed, step by step, for a greedy target output.

    draft_next[i] is the draft's argmax after prompt + output_ids[:i] (teacher forced). While the drafts match
    the output they are exactly what the draft would have proposed autoregressively, and the first mismatch
    ends the step, so the replay is exact. output_ids ends with the end-of-sequence token when it stopped.
    """
    n = len(output_ids)
    i = 0
    while i < n:
        k_step = step_k(k, max_tokens, i)
        accepted = 0
        while accepted < k_step and i + accepted < n and draft_next[i + accepted] == output_ids[i + accepted]:
            accepted += 1
        end = min(i + accepted + 1, n)
        ids = list(output_ids[i:end])
        yield CommittedBatch(ids=ids, drafted=k_step, accepted=accepted, finished=stopped and end == n)
        i = end
