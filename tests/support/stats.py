"""Pearson chi-square helpers for the statistical tests (tolerances stated where they are used)."""

from __future__ import annotations

import itertools

import torch

from speculation.engine import probs_from_logits
from speculation.engine.sampling import SamplingParams

P_VALUE = 1e-3


def chi2_critical(dof: int, p_value: float = P_VALUE) -> float:
    """Wilson-Hilferty approximation of the chi-square upper quantile (accurate to ~1 % for dof >= 3)."""
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(1.0 - p_value)).item()
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over cells with expected count >= 5 (the rest pooled into one cell)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum().item()) - 1


def wrong_verify_sampled(draft_tokens, q, p, generator):
    """The classic bug: on rejection, resample from p instead of the residual norm(max(0, p - q))."""
    k = draft_tokens.shape[0]
    if q is None:
        q = torch.nn.functional.one_hot(draft_tokens, p.shape[-1]).to(p.dtype)
    u = torch.rand(k, generator=generator)
    p_d = p[:k].gather(-1, draft_tokens[:, None]).squeeze(-1)
    q_d = q.gather(-1, draft_tokens[:, None]).squeeze(-1)
    num_accepted = (u * q_d < p_d).long().cumprod(0).sum()
    replacement = torch.multinomial(p, 1, generator=generator).squeeze(-1)
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
    return num_accepted, torch.where(torch.arange(k + 1) < num_accepted, padded, replacement)


def exact_sequence_distribution(target, prompt: list[int], length: int, params: SamplingParams) -> torch.Tensor:
    """P(first `length` tokens) by enumeration: the product of the target's processed conditionals."""
    vocab = target.vocab_size
    probs = torch.zeros(vocab**length)
    for index, seq in enumerate(itertools.product(range(vocab), repeat=length)):
        tokens = torch.tensor(prompt + list(seq))
        target.setup_cache(target.max_len)
        logits = target(tokens, 0).logits[len(prompt) - 1 : -1]  # [length, V]
        p = probs_from_logits(logits, params)
        probs[index] = p[torch.arange(length), torch.tensor(seq)].prod()
    return probs
