"""Shadow replay: what greedy speculation with lookahead K would have done on a finished request.

In greedy speculation an accepted draft token equals the target's token, so the draft always proposes
from the true prefix: at committed length n it proposes draft_next[n-1], draft_next[n], ... (its
teacher-forced greedy predictions) and the step accepts them while they equal the target's tokens.
One teacher-forced draft pass over prompt + output therefore replays every step exactly, with the same
per-step lookahead rule as ``generate`` (``step_lookahead``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import torch

from speculation.engine.decode import step_lookahead
from speculation.engine.errors import EmptyPromptError
from speculation.engine.lookahead import check_k
from speculation.engine.model import Transformer
from speculation.engine.stats import SpecStats


def replay_greedy(
    draft_next_tokens: Sequence[int],
    target_tokens: Sequence[int],
    k: int,
    *,
    prompt_len: int,
    max_new_tokens: int | None = None,
    max_context: int | None = None,
) -> SpecStats:
    """Replay greedy speculation on one request.

    draft_next_tokens[i]: the draft's greedy prediction for position i + 1 given tokens[0..i] (teacher forced,
    from ``draft_greedy_predictions``), for at least the first len(target_tokens) - 1 positions.
    target_tokens: prompt followed by the target's output (a stop token, when it ended the output, last).
    max_new_tokens / max_context: the request's limits, as generate applied them (max_context: the target's
    context when the request set none; None here = unbounded). They shorten the last steps as in generate.
    """
    if len(draft_next_tokens) < len(target_tokens) - 1:
        raise ValueError("need the draft's prediction at every position but the last")

    def propose(n: int, drafted: int) -> list[int]:
        # the draft always proposes `drafted` tokens; those past the known output are never compared (padding)
        known = list(draft_next_tokens[n - 1 : n - 1 + drafted])
        return known + [-1] * (drafted - len(known))

    return replay_proposals(
        propose,
        target_tokens,
        k,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        max_context=max_context,
    )


Propose = Callable[[int, int], Sequence[int]]  # (committed length n, at most this many) -> the drafts


def replay_proposals(
    propose: Propose,
    target_tokens: Sequence[int],
    k: int,
    *,
    prompt_len: int,
    max_new_tokens: int | None = None,
    max_context: int | None = None,
) -> SpecStats:
    """Replay greedy speculation with any proposer whose drafts depend only on the committed tokens.

    propose(n, d): the drafts (at most d, possibly fewer or none) after target_tokens[:n]; in greedy speculation
    the committed tokens are always the target's, so this is exact for a draft model (its teacher-forced
    predictions) and for n-gram prompt lookup (a function of the context). A step with no drafts is a plain step.
    """
    check_k(k)
    if prompt_len < 1:
        raise EmptyPromptError("the prompt has no tokens")
    total = len(target_tokens)
    max_new = total - prompt_len if max_new_tokens is None else max_new_tokens
    limit = sys.maxsize if max_context is None else max_context
    stats = SpecStats()
    n = prompt_len
    while n < total:
        drafts = propose(n, step_lookahead(k, n - prompt_len, n, max_new, limit))
        drafted, accepted, reached = len(drafts), 0, 0
        for i in range(drafted):
            if n + i >= total:  # the output ended (stop token) inside this step's accepted drafts
                break
            reached += 1
            if drafts[i] != target_tokens[n + i]:
                break
            accepted += 1
        stats.record_step(drafted=drafted, accepted=accepted, reached=reached)
        n = min(n + accepted + 1, total)
    stats.output_tokens = total - prompt_len
    return stats


@torch.inference_mode()
def draft_greedy_predictions(draft: Transformer, token_ids: Sequence[int], *, chunk: int = 256) -> list[int]:
    """The draft's teacher-forced greedy next token after every prefix: [i] predicts token_ids[i + 1]."""
    if not token_ids:
        return []
    device = draft.output.weight.device
    ids = torch.tensor(list(token_ids), device=device)
    if ids.numel() > draft.max_len:
        raise ValueError(f"sequence of {ids.numel()} tokens exceeds the draft's cache of {draft.max_len}")
    preds = [draft(ids[s : s + chunk], s).logits.argmax(-1) for s in range(0, ids.numel(), chunk)]
    return torch.cat(preds).tolist()


def expected_acceptance(target_logprobs: Sequence[dict[int, float]], draft_probs: torch.Tensor) -> float:
    """Mean over positions of sum_x min(p(x), q(x)) = 1 - TV(p, q): the expected per-position acceptance.

    target_logprobs[i]: the target's log-probabilities at position i (token id -> logprob; top-N from a
    server is fine: the mass it leaves out counts as disagreement, so the estimate is a lower bound).
    draft_probs: [positions, V] the draft's (processed) probabilities at the same positions.
    """
    if len(target_logprobs) != draft_probs.shape[0]:
        raise ValueError("one target distribution per draft position is needed")
    if not target_logprobs:
        return 0.0
    total = 0.0
    q = draft_probs.float().cpu()
    for i, dist in enumerate(target_logprobs):
        ids = torch.tensor(list(dist.keys()), dtype=torch.long)
        p = torch.tensor([math.exp(v) for v in dist.values()])
        total += torch.minimum(p, q[i, ids]).sum().item()
    return total / len(target_logprobs)
