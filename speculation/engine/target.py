"""Targets: the model whose distribution the output must follow, behind one small protocol.

Invariant kept by the decode loop: the target has processed every committed token except the last one
(``length == committed - 1``); a step feeds [last committed, d_1..d_K] and keeps what was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from speculation.engine.batch_model import HiddenRequest
from speculation.engine.model import Transformer


@dataclass
class TargetOutput:
    logits: Tensor  # [T, V]
    hidden: Tensor | None  # [T, D] final-norm features (or several layers', model.HiddenRequest), when asked for


@runtime_checkable
class Target(Protocol):
    vocab_size: int
    max_context: int
    device: torch.device

    def prefill(self, prompt_ids: list[int]) -> None:
        """Start a request: process every prompt token but the last.

        A target that can (LocalTarget) also takes ``return_hidden=True`` and returns the prompt's TargetOutput,
        so an EAGLE head gets the prompt's features without a second pass.
        """

    def forward(self, tokens: Tensor, *, return_hidden: bool = False) -> TargetOutput:
        """Process tokens at the next positions (after the cached ones) and return their logits."""

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` cached positions."""


class LocalTarget:
    """A Transformer in this process; its KV cache rolls back by moving ``length``."""

    def __init__(self, model: Transformer, *, max_context: int | None = None):
        self.model = model
        if max_context is not None and max_context > model.max_len:
            model.setup_cache(max_context)
        self.max_context = min(max_context or model.max_len, model.max_len)
        self.vocab_size = model.vocab_size
        self.device = model.output.weight.device
        self.length = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int], *, return_hidden: HiddenRequest = False) -> TargetOutput | None:
        self.length = 0
        if len(prompt_ids) > 1:
            return self.forward(torch.tensor(prompt_ids[:-1], device=self.device), return_hidden=return_hidden)
        return None

    @torch.inference_mode()
    def forward(self, tokens: Tensor, *, return_hidden: HiddenRequest = False) -> TargetOutput:
        out = self.model(tokens, self.length, return_hidden=return_hidden)
        self.length += tokens.shape[0]
        return TargetOutput(logits=out.logits, hidden=out.hidden)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} positions are cached")
        self.length = length


class TargetRow:
    """A Target as the one row of a batch (engine/batch.py's BatchedModel interface), so that a single request on
    any target (LocalTarget, a ReplayTarget, a remote or a transformers model) runs the batch engine's step.

    The target keeps its own cache: a forward at ``starts[0]`` continues from there (the step keeps the accepted
    positions with ``keep``, as the target's rollback). The last forward's features (``return_hidden``: what an
    EAGLE head reads) stay in ``hidden``."""

    rows = 1

    def __init__(self, target: Target, *, return_hidden: HiddenRequest = False) -> None:
        self.target = target
        self.device = target.device
        self.vocab_size = target.vocab_size
        self.max_len = target.max_context
        self.return_hidden = return_hidden
        self.hidden: Tensor | None = None

    def reserve(self, rows: int, positions: int) -> None:
        if rows > 1:
            raise ValueError("a target row holds one request")

    def prefill(self, prompt_ids: list[int]) -> Tensor | None:
        """The target's prefill (every prompt token but the last); the prompt's features when asked for."""
        wants = self.return_hidden
        out = self.target.prefill(prompt_ids, return_hidden=wants) if wants else self.target.prefill(prompt_ids)
        return out.hidden if out is not None else None

    def forward(self, tokens: Tensor, starts: list[int], **_) -> Tensor:
        """tokens [1, T] after the cached positions -> logits [1, T, V]."""
        out = self.target.forward(tokens[0], return_hidden=self.return_hidden)
        self.hidden = out.hidden
        return out.logits[None]

    def keep(self, row: int, length: int) -> None:
        self.target.rollback(length)
