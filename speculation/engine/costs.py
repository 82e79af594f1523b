"""Timing the two costs the projection and the lookahead controller divide by, on this machine.

- a draft step: one proposed token, timed as the decode loop times it (a proposal of several tokens over a
  warm draft cache, divided by the tokens proposed);
- a verification of n tokens: one target forward of [last committed, d_1..d_{n-1}] after the context, and
  the step's one device read, then rolled back (any Target: the local model or the server's scoring call).

Each timing is repeated and summarised by its fastest repeat (SUMMARY): what the work itself costs on this
machine, since another process on the same cores (on a small node: the model server serving the very traffic
shadow measures, while in prod the worker does that work instead), a garbage collection or a page fault only
ever add to it. On a shared 2-core machine the median of five still kept such contention (verify timings 10-50x
what prod then ran at); on a dedicated GPU the fastest and the median agree. Sizes are interleaved across repeats
so that a drift hits every size alike, and verify costs are pooled to be non-decreasing in the tokens verified.
Pure torch + stdlib (speculation.engine).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from speculation.engine.projection import non_decreasing
from speculation.engine.proposers import Proposer
from speculation.engine.sampling import SamplingParams
from speculation.engine.target import Target

__all__ = ["REPEATS", "SUMMARY", "non_decreasing", "time_draft_step", "time_verify"]

REPEATS = 5
SUMMARY = min  # of the repeats: see the module docstring
DRAFT_STEPS = 8  # tokens per timed proposal: long enough that the fed-back committed token is amortised
GREEDY = SamplingParams(temperature=0.0)


def time_draft_step(
    proposer: Proposer, context: list[int], *, steps: int = DRAFT_STEPS, repeats: int = REPEATS
) -> float:
    """Seconds per drafted token (the fastest repeat), the draft's cache warm with `context` (as in the loop)."""
    if not context:
        raise ValueError("timing a draft step needs a context of at least one token")
    committed = list(context)
    proposer.begin(committed)
    proposer.on_verified(0, int(proposer.propose(committed, 1, GREEDY, None).tokens.shape[0]))  # warm: prefill
    samples: list[float] = []
    for i in range(repeats):
        committed.append(committed[i % len(context)])  # the step's committed token, as after a verification
        started = time.perf_counter()
        drafts = proposer.propose(committed, steps, GREEDY, None).tokens.tolist()  # the loop's one device read
        elapsed = time.perf_counter() - started
        proposer.on_verified(0, len(drafts))
        if drafts:
            samples.append(elapsed / len(drafts))
    return SUMMARY(samples) if samples else 0.0


def time_verify(
    target: Target, context: list[int], sizes: Iterable[int], *, repeats: int = REPEATS
) -> dict[int, float]:
    """Seconds of one target forward of n tokens after `context` (the fastest repeat), for every n in sizes."""
    sizes = sorted({int(n) for n in sizes if int(n) > 0})
    if not context or not sizes:
        raise ValueError("timing a verification needs a context and at least one size")
    cached = len(context) - 1
    tokens = torch.tensor([context[(cached + j) % len(context)] for j in range(max(sizes))], device=target.device)
    target.prefill(context)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            started = time.perf_counter()
            out = target.forward(tokens[:n])
            out.logits.argmax(-1).tolist()  # the step's one device read
            samples[n].append(time.perf_counter() - started)
            target.rollback(cached)
    return non_decreasing({n: SUMMARY(values) for n, values in samples.items()})
