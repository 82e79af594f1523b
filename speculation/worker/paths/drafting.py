"""Draft-side pieces the worker paths need, on the engine (speculation.engine): no model code of their own.

- ``StepProposer``: the stage loop's ``propose(context, k) -> list[int]`` over an engine proposer (greedy),
  keeping the draft's KV cache across steps: the engine's begin()/on_verified() calls are made here.
- ``teacher_forced_next`` / ``teacher_forced_logits``: a model's prediction at every output position of a
  finished request (one teacher-forced pass), for the shadow replay.
"""

from __future__ import annotations

import torch

from speculation.engine import SamplingParams, Transformer, draft_greedy_predictions
from speculation.engine.proposers import Proposer

GREEDY = SamplingParams(temperature=0.0)


class StepProposer:
    """Greedy proposals for greedy_speculate from an engine proposer (DraftModelProposer, NgramProposer).

    The engine's proposer learns after each proposal how many drafts were kept (on_verified). Here that count
    is read off the next context: the tokens after the previous context that equal the previous drafts. A
    context that does not extend the previous one starts the proposer afresh (begin), so it is never wrong.
    """

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self._context: list[int] | None = None  # the context of the last proposal
        self._drafts: list[int] = []

    def propose(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        previous = self._context
        if previous is None or len(context) <= len(previous) or context[: len(previous)] != previous:
            self.proposer.begin(context)
        elif self._drafts:
            new = context[len(previous) :]
            kept, limit = 0, min(len(new) - 1, len(self._drafts))  # the newest context token is always fed
            while kept < limit and new[kept] == self._drafts[kept]:
                kept += 1
            self.proposer.on_verified(kept, len(self._drafts))
        drafts = self.proposer.propose(context, k, GREEDY, None).tokens.tolist()
        self._context, self._drafts = list(context), drafts
        return drafts


def teacher_forced_next(model: Transformer, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """draft_next[i] = the draft's argmax after prompt + output[:i], for i in 0..len(output)-1 (one pass)."""
    if not output_ids:
        return []
    predictions = draft_greedy_predictions(model, prompt_ids + output_ids[:-1])  # [j] follows tokens[: j + 1]
    return predictions[len(prompt_ids) - 1 :]


@torch.inference_mode()
def teacher_forced_logits(
    model: Transformer, prompt_ids: list[int], output_ids: list[int], *, chunk: int = 256
) -> torch.Tensor:
    """[len(output), V]: a model's logits at every output position, teacher forced (draft or target)."""
    tokens = prompt_ids + output_ids[:-1]
    if len(tokens) > model.max_len:
        raise ValueError(f"sequence of {len(tokens)} tokens exceeds the model's cache of {model.max_len}")
    ids = torch.tensor(tokens, device=model.output.weight.device)
    logits = torch.cat([model(ids[s : s + chunk], s).logits for s in range(0, len(tokens), chunk)])  # [P + n - 1, V]
    return logits[len(prompt_ids) - 1 :].float().cpu()


def teacher_forced_probs(model: Transformer, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output), V]: the draft's distribution (temperature 1) at every output position, teacher forced."""
    return torch.softmax(teacher_forced_logits(model, prompt_ids, output_ids), dim=-1)
