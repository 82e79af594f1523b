"""Timing the local path as prod runs it when the worker batches (speculation.worker.batching): one row of the
batch engine's BatchedModel, the same forward the BatchDecoder runs for a lone request (padding-free row 0, its own
cache, the attention mask of the batch), not the batch-1 Transformer with its static cache. At batch size 1 the two
differ by a fixed cost per forward (measured: a lone request in the batch ran at 23 tok/s where the single-stream
loop ran at 29), which a projection timed on the wrong one carries into every K.

``BatchRowTarget`` is the engine's Target protocol and ``BatchRowDraft`` its Proposer protocol over one row, for
speculation.engine.costs.time_verify / time_draft_step only: greedy drafts, no sampling.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speculation.engine.batch_model import BatchedModel
from speculation.engine.model import Transformer
from speculation.engine.proposers import Proposal
from speculation.engine.sampling import SamplingParams
from speculation.engine.target import TargetOutput


class BatchRowTarget:
    """A target verifying on row 0 of a BatchedModel, as BatchDecoder._verify does for one slot."""

    def __init__(self, model: Transformer) -> None:
        self.rows = BatchedModel(model, max_rows=1)
        self.device = self.rows.device
        self.vocab_size = model.vocab_size
        self.max_context = self.rows.max_len
        self.length = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> None:
        self.length = 0
        if len(prompt_ids) > 1:
            self.rows.reserve(1, len(prompt_ids))
            self.rows.forward(torch.tensor(prompt_ids[:-1], device=self.device)[None], [0])
            self.length = len(prompt_ids) - 1

    @torch.inference_mode()
    def forward(self, tokens: Tensor, *, return_hidden: bool = False) -> TargetOutput:
        t = int(tokens.shape[0])
        self.rows.reserve(1, self.length + t)
        logits = self.rows.forward(tokens[None], [self.length])[0]  # [T, V]
        self.length += t
        return TargetOutput(logits=logits, hidden=None)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} positions are cached")
        self.length = length


class BatchRowDraft:
    """A draft model proposing on row 0 of a BatchedModel, as BatchDecoder._draft_model_proposals does for one
    slot: one forward feeding the committed tokens the row has not seen, then one per further draft token."""

    wants_hidden = False

    def __init__(self, model: Transformer) -> None:
        self.rows = BatchedModel(model, max_rows=1)
        self.device = self.rows.device
        self.length = 0  # committed tokens the row holds

    def begin(self, prompt_ids: list[int]) -> None:
        self.length = 0

    @torch.inference_mode()
    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        self.rows.reserve(1, len(committed) + k)
        feed = torch.tensor(committed[self.length :], device=self.device)[None]  # [1, unseen]
        logits = self.rows.forward(feed, [self.length], last=[feed.shape[1] - 1])  # [1, V]
        position, tokens = len(committed), []
        for j in range(k):
            token = logits.argmax(-1)  # [1]
            tokens.append(token)
            if j + 1 < k:  # the last draft token is never fed
                logits = self.rows.forward(token[:, None], [position], last=[0])
                position += 1
        self.length = len(committed)  # the drafts fed are rewritten next time (nothing accepted is assumed)
        return Proposal(tokens=torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long), q=None)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        pass
