"""One request's terms, shared by every decoding path: its configuration and result, the checks on its prompt,
how many drafts a step may carry, and where its output ends.

The step itself (draft, verify in one target pass, commit) is engine/batch.py's; decode.generate runs it for one
request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from speculation.engine.errors import ContextLengthError, EmptyPromptError, VocabMismatchError
from speculation.engine.lookahead import DEFAULT_K, DynamicLookahead, TreeLookahead, check_k
from speculation.engine.sampling import SamplingParams
from speculation.engine.stats import SpecStats
from speculation.engine.target import Target

OnTokens = Callable[[list[int]], "bool | None"]  # returns True to end the request after these tokens
EndsAfter = Callable[[int], bool]  # asked for each committed token in order: does the request end after it?


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    k: int = DEFAULT_K
    dynamic_k: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's min_tokens: the target may not produce suppress_ids before min_tokens output tokens.
    min_tokens: int = 0
    suppress_ids: tuple[int, ...] = ()
    seed: int = 0
    max_context: int | None = None  # None: the target's
    # a sampled request keeps K (the batch loop's controller does not choose it), so that the same seed gives the same
    # tokens whatever the load; False for a request that set no seed (nothing to reproduce: any K is as exact)
    fixed_k: bool = True

    def __post_init__(self) -> None:
        if self.k != 0:  # K = 0: plain decoding through the same loop (what a speculative step is compared with)
            check_k(self.k)
        self.sampling  # validates temperature / top_k / top_p  # noqa: B018
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens only (a stop token, when hit, is the last one)
    stats: SpecStats
    finish_reason: str  # "stop" | "length"
    k_history: list[int] = field(default_factory=list)  # K used at each step (dynamic K)


def step_lookahead(k: int, emitted: int, committed: int, max_new_tokens: int, max_context: int) -> int:
    """How many drafts a step may carry: the step commits at most k + 1 tokens, within both limits.

    Shared with the shadow replay, so both agree on the last steps of a request.
    """
    return max(0, min(k, max_new_tokens - emitted - 1, max_context - committed - 1))


def check_request(target: Target, prompt_ids: list[int], config: GenerationConfig) -> int:
    if not prompt_ids:
        raise EmptyPromptError("the prompt has no tokens")
    max_context = min(config.max_context or target.max_context, target.max_context)
    if len(prompt_ids) > max_context:
        raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens; the context holds {max_context}")
    if max(prompt_ids) >= target.vocab_size or min(prompt_ids) < 0:
        raise VocabMismatchError(f"prompt token ids must be in [0, {target.vocab_size})")
    return max_context


def default_lookahead(proposer: object, k: int) -> DynamicLookahead:
    """Dynamic K for this proposer: a TreeLookahead over its tree's family when it drafts trees (EagleProposer)."""
    tree = getattr(proposer, "tree", None)
    if tree is not None:
        return TreeLookahead.for_tree(tree, k_max=k, k_start=k)
    return DynamicLookahead(k_max=k, k_start=k)


def stop_check(stop_ids: frozenset[int], ends_after: EndsAfter | None) -> Callable[[int], bool]:
    if ends_after is None:
        return stop_ids.__contains__

    def is_stop(token: int) -> bool:
        ended = ends_after(token)  # asked once for every kept token, in order
        return ended or token in stop_ids

    return is_stop


def truncate_at_stop(
    new: list[int], accepted: int, drafted: int, stop: Callable[[int], bool] | frozenset[int]
) -> tuple[list[int], int, int, bool]:
    """Cut a step's tokens after the first one that ends the request (stop: the stop token ids, or a check
    asked once per token in order); count only drafts that were emitted.

    (tokens kept, accepted drafts kept, positions reached, stopped). Also for steps committed outside this loop
    (the batched step, the worker's batch loop), so every step is counted alike.
    """
    is_stop = stop if callable(stop) else stop.__contains__
    reached = min(accepted + 1, drafted)
    for i, token in enumerate(new):
        if is_stop(token):
            if i < accepted:  # the stop token is an accepted draft: drafts after it are never emitted
                return new[: i + 1], i + 1, i + 1, True
            return new[: i + 1], accepted, reached, True
    return new, accepted, reached, False
