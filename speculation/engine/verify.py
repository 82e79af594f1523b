"""Verification of K draft tokens against one target pass (Leviathan et al. 2023, Alg. 1; Chen et al. 2023).

p = the target's processed distribution at each of the K+1 positions, q = the draft's at the K draft positions.

- accepted tokens: the leading draft tokens that pass; draft token i passes with probability
  min(1, p_i(d_i) / q_i(d_i)) (greedy: when d_i == argmax p_i).
- recovered token: at the first rejection i, one token from norm(max(0, p_i - q_i)) (greedy: argmax p_i).
- bonus token: when all K pass, one token from p_K.

One-hot drafts (n-gram, or a greedy draft under sampling) pass q = None: q is then the one-hot of d, so the
pass probability is p(d) and the residual is p with d removed, renormalised. The output is distributed exactly
as p. Both functions stay on the device: they return tensors, and the caller reads them once per step.
"""

from __future__ import annotations

import torch
from torch import Tensor


def verify_greedy(draft_tokens: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft_tokens [K], target_logits [K+1, V] -> (num_accepted [], tokens [K+1]).

    tokens[:num_accepted] are the accepted drafts, tokens[num_accepted] the recovered or bonus token.
    """
    best = target_logits.argmax(-1)  # [K+1]
    matches = (draft_tokens == best[: draft_tokens.shape[0]]).long()  # [K]
    num_accepted = matches.cumprod(0).sum()
    return num_accepted, best


def verify_sampled(
    draft_tokens: Tensor, q: Tensor | None, p: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """draft_tokens [K], q [K, V] or None (one-hot drafts), p [K+1, V] -> (num_accepted [], tokens [K+1])."""
    k = draft_tokens.shape[0]
    p_draft = p[:k].gather(-1, draft_tokens[:, None]).squeeze(-1)  # [K]
    if q is None:
        q = torch.nn.functional.one_hot(draft_tokens, p.shape[-1]).to(p.dtype)  # [K, V]
    q_draft = q.gather(-1, draft_tokens[:, None]).squeeze(-1)  # [K]
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u * q_draft < p_draft).long()  # u < p/q without dividing
    num_accepted = accepted.cumprod(0).sum()
    residual = (p[:k] - q).clamp_min(0.0)  # [K, V]
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:k])  # p == q: rejection impossible
    candidates = torch.cat([residual, p[k:]])  # [K+1, V]: recovered at each position, bonus at K
    replacement = torch.multinomial(candidates, 1, generator=generator).squeeze(-1)  # [K+1]
    positions = torch.arange(k + 1, device=p.device)
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
    tokens = torch.where(positions < num_accepted, padded, replacement)
    return num_accepted, tokens
