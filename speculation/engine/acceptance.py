"""Expected acceptance of speculative sampling, sum_x min(p(x), q(x)) = 1 - TV(p, q), per position.

p = the target's processed distribution, q = the draft's, both processed as the request asks (temperature,
then top-k, then top-p: ``probs_from_logits``). With the target's logits at hand it is exact. From a server's
top-N raw log-probabilities (``target_from_top_logprobs``) p is known exactly when 0 < top_k < N with no tie
at the cut (its support is then the true top-k); otherwise each returned token gets a lower bound on p(x)
and the rest of the mass (``unseen``) is not attributed, so the acceptance is a lower bound:

- the unseen tokens each have raw probability <= p_N (the N-th returned) and together R = 1 - sum(seen), so
  their tempered weight sum_u p_u^(1/T) is at most p_N^(1/T - 1) R for T <= 1, and at most
  min((V - N)^(1 - 1/T) R^(1/T), (V - N) p_N^(1/T)) for T > 1 (Hölder);
- the normaliser after temperature and top-k therefore lies in [Z_seen, Z_seen + U];
- a returned token is provably inside the top-p nucleus when the mass before it is below top_p even with the
  smallest normaliser, and then p(x) >= w(x) / (Z_seen + U) (renormalising over the nucleus only raises it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from speculation.engine.sampling import SamplingParams, probs_from_logits


@dataclass(frozen=True)
class TargetBound:
    p: Tensor  # [V] the processed distribution (exact) or a lower bound on it, per token
    exact: bool

    @property
    def unseen(self) -> float:
        """Mass the bound leaves unattributed (0 when exact)."""
        return 0.0 if self.exact else max(0.0, 1.0 - float(self.p.sum()))


def expected_acceptance_exact(p: Tensor, q: Tensor) -> Tensor:
    """p, q [n, V] processed distributions -> [n] expected acceptance per position."""
    return torch.minimum(p.float(), q.float()).sum(-1)


def pass_given_tokens(p: Tensor, q: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """p, q [n, V] processed distributions, tokens [n] the tokens sampled there -> (per token [n], average [n]).

    Per token: the probability that a draft sampled from q passed given that the step's token is o,
    q(o) min(1, p(o) / q(o)) / p(o) = min(1, q(o) / p(o)) (a rejected draft's residual never gives o back where
    q(o) >= p(o)); averaged over o ~ p it is sum_x min(p, q) (``average``), which stands in where p(o) = 0 (a server's
    processing that differs from ours at a top-p cut). A token beyond q's vocabulary is never drafted: 0."""
    rows = torch.arange(tokens.numel())
    inside = tokens < q.shape[-1]
    tokens = torch.where(inside, tokens, 0)
    p_o = p[rows, tokens].float()
    q_o = torch.where(inside, q[rows, tokens].float(), 0.0)
    average = expected_acceptance_exact(p, q)
    return torch.where(p_o > 0, torch.clamp(q_o / p_o.clamp(min=1e-30), max=1.0), average), average


def target_from_top_logprobs(top: Mapping[int, float], params: SamplingParams, vocab_size: int) -> TargetBound:
    """The target's processed distribution at one position from its top-N raw log-probabilities (token -> logprob,
    the N most likely tokens): exact when top-k < N decides the support, else a per-token lower bound."""
    if params.greedy:
        raise ValueError("greedy traffic needs no distribution: its replay is exact")
    ranked = sorted(top.items(), key=lambda item: -item[1])
    n = len(ranked)
    if n == 0:
        return TargetBound(p=torch.zeros(vocab_size), exact=False)
    tokens = torch.tensor([t for t, _ in ranked], dtype=torch.long)
    logprobs = torch.tensor([lp for _, lp in ranked], dtype=torch.float64)
    k = params.top_k
    if 0 < k < n and logprobs[k] < logprobs[k - 1] and int(tokens.max()) < vocab_size:
        logits = torch.full((vocab_size,), float("-inf"))
        logits[tokens] = logprobs.float()
        return TargetBound(p=probs_from_logits(logits, params), exact=True)
    a = 1.0 / params.temperature
    weights = torch.exp(a * logprobs)  # tempered, unnormalised, on the raw scale (sum over the vocabulary ~ Z)
    # top-k keeps these returned tokens (ties at the cut included; unseen ties are within the unseen bound)
    kept = n if k == 0 or k >= n else int((logprobs >= logprobs[k - 1]).sum())
    rest = max(0.0, 1.0 - float(torch.exp(logprobs).sum()))
    p_last = math.exp(float(logprobs[-1]))
    others = max(0, vocab_size - n)
    if a >= 1.0:
        unseen_weight = p_last ** (a - 1.0) * rest
    else:
        unseen_weight = min(others ** (1.0 - a) * rest**a, others * p_last**a)
    z_low = float(weights[:kept].sum())
    z_high = z_low + unseen_weight
    before = torch.cumsum(weights[:kept], 0) - weights[:kept]  # mass ranked above each kept token
    in_nucleus = before / z_low < params.top_p if params.top_p < 1.0 else torch.ones(kept, dtype=torch.bool)
    width = max(vocab_size, int(tokens.max()) + 1)  # a server token beyond the draft's vocabulary: bounded to 0
    p = torch.zeros(width, dtype=torch.float64)
    p[tokens[:kept]] = torch.where(in_nucleus, weights[:kept] / z_high, torch.zeros(kept, dtype=torch.float64))
    return TargetBound(p=p[:vocab_size].float(), exact=False)


def expected_acceptance_from_top(
    top: list[Mapping[int, float]], q: Tensor, params: SamplingParams
) -> tuple[Tensor, Tensor, bool]:
    """Per position: (acceptance [n] (exact or a lower bound), unseen mass [n], all exact) for q [n, V]."""
    if len(top) != q.shape[0]:
        raise ValueError("one target distribution per draft position is needed")
    bounds = [target_from_top_logprobs(dist, params, q.shape[-1]) for dist in top]
    if not bounds:
        return torch.zeros(0), torch.zeros(0), True
    p = torch.stack([b.p for b in bounds])  # [n, V]
    unseen = torch.tensor([b.unseen for b in bounds])
    return expected_acceptance_exact(p, q), unseen, all(b.exact for b in bounds)
