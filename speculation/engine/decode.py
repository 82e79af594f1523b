"""One request through the engine's step: ``generate(target, proposer, prompt_ids, config)`` returns the tokens and
a SpecStats.

The step is engine/batch.py's BatchDecoder.step (draft, verify in one target pass, commit, keep the accepted
positions), run here for a batch of one on any Target with any Proposer. With temperature 0 the output equals plain
greedy decoding of the target; with temperature > 0 it is distributed exactly as the target's (processed)
distribution. The step reads the device once (accepted count and tokens).
"""

from __future__ import annotations

import dataclasses

from speculation.engine.batch import BatchDecoder
from speculation.engine.lookahead import Lookahead
from speculation.engine.proposers import Proposer
from speculation.engine.request import (
    EndsAfter,
    GenerationConfig,
    GenerationResult,
    OnTokens,
    default_lookahead,
)
from speculation.engine.stats import SpecStats
from speculation.engine.target import Target


def generate(
    target: Target,
    proposer: Proposer | None,
    prompt_ids: list[int],
    config: GenerationConfig,
    on_tokens: OnTokens | None = None,
    *,
    lookahead: Lookahead | None = None,
    ends_after: EndsAfter | None = None,
) -> GenerationResult:
    """Speculative decoding (plain decoding when proposer is None).

    on_tokens gets each step's committed tokens (to stream them); returning True ends the request after them.
    ends_after is asked for every committed token, in order, whether the request ends after it (a rule the loop
    cannot see: a stop string, the end of a replayed output): the step is cut there, as at a stop token, and the
    stats count only the drafts that were kept.

    With ``config.dynamic_k``, pass the same ``lookahead`` to successive requests (one per target/draft pair)
    so its acceptance and cost estimates carry over; by default each request starts a fresh one (a TreeLookahead
    for a draft-tree proposer: it sizes the tree's width too). A lone request follows the controller whatever its
    sampling: there is no load for its K to depend on.
    """
    if not config.dynamic_k:
        lookahead = None
    elif lookahead is None:
        lookahead = default_lookahead(proposer, config.k)
    if lookahead is not None and config.fixed_k:
        config = dataclasses.replace(config, fixed_k=False)
    decoder = BatchDecoder(target, slots=1, proposer=proposer, lookahead=lookahead)
    decoder.add(0, prompt_ids, config, ends_after=ends_after)
    out: list[int] = []
    k_history: list[int] = []
    while True:
        (update,) = decoder.step()
        out.extend(update.tokens)
        if lookahead is not None and update.tokens:  # a step ran (a request with nothing to generate has none)
            k_history.append(update.drafted)
        stats, finish = update.stats, update.finish_reason
        if on_tokens is not None and update.tokens and on_tokens(update.tokens):
            finish = "stop"  # the caller ended the request (a stop string matched)
            stats = decoder.remove(0) or stats
        if finish is not None:
            return GenerationResult(tokens=out, stats=stats or SpecStats(), finish_reason=finish, k_history=k_history)


def generate_plain(
    target: Target, prompt_ids: list[int], config: GenerationConfig, on_tokens: OnTokens | None = None
) -> GenerationResult:
    """Plain decoding through the same target and step: one target pass per token (the baseline)."""
    return generate(target, None, prompt_ids, config, on_tokens)
