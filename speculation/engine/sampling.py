"""Turning logits into the distribution that is sampled: temperature, then top-k, then top-p.

The same function is applied to the target's logits (p) and to the draft's (q), as exactness requires.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from speculation.engine.errors import SamplingParamError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also refuses NaN
            raise SamplingParamError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingParamError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def suppress_before_min_tokens(
    logits: Tensor, produced: int, min_tokens: int, ids: Tensor | None, row_depths: Tensor | None = None
) -> Tensor:
    """Logits [R, V] whose rows cannot pick ``ids`` before ``min_tokens`` outputs (vLLM's min_tokens). Row r picks
    output token produced + depth(r): r for a chain of drafts, ``row_depths[r]`` for a draft tree. A copy when it
    changes anything (the target's logits may be inference tensors)."""
    if ids is None or not ids.numel() or min_tokens <= produced:
        return logits
    logits = logits.clone()
    if row_depths is None:
        logits[: min_tokens - produced, ids] = float("-inf")
    else:
        rows = (row_depths < min_tokens - produced).nonzero().squeeze(-1)
        logits[rows[:, None], ids[None, :]] = float("-inf")
    return logits


def probs_from_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """logits [..., V] -> processed probabilities [..., V] (float32); greedy gives a one-hot of the argmax."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # keep a token while the mass before it < top_p
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [..., V] -> [...] (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
