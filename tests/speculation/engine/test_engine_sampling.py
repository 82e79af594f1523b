"""Speculative sampling is distributed exactly as the target's (processed) distribution, and is seeded.

Statistical tests: Pearson chi-square of sampled counts against the exact distribution, rejecting at
p < 1e-3 (critical value from the chi-square quantile; the false-alarm rate per test is 0.1 %). Each test
runs the same check on a deliberately wrong sampler (recovered token drawn from p instead of
norm(max(0, p - q))) and requires it to be rejected, so the check has power at its sample size.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    NgramProposer,
    SamplingParams,
    generate,
    probs_from_logits,
    verify_sampled,
)
from speculation.engine import decode as decode_module

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


@pytest.mark.parametrize("one_hot", [False, True])
def test_verification_emits_tokens_distributed_as_p_and_the_wrong_sampler_is_caught(one_hot):
    # given fixed p (3 positions) and q (2 draft positions) over 6 tokens; 3,000 verifications, each with
    # drafts drawn from q (or, one-hot: a fixed draft, q = its one-hot)
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=generator) * 1.5, -1)
    q = torch.softmax(torch.randn(2, 6, generator=generator) * 1.5, -1)
    fixed = torch.tensor([int(q[0].argmax()), int(q[1].argmax())])
    n = 3_000
    for verify, should_pass in ((verify_sampled, True), (wrong_verify_sampled, False)):
        # when: the first emitted token is counted (accepted draft 0 or recovered at 0)
        counts = torch.zeros(6)
        for _ in range(n):
            drafts = fixed if one_hot else torch.multinomial(q, 1, generator=generator).squeeze(-1)
            _, tokens = verify(drafts, None if one_hot else q, p, generator)
            counts[tokens[0]] += 1
        # then: it is distributed as p[0]; the wrong sampler is rejected
        stat, dof = chi2_statistic(counts, p[0])
        print(f"{verify.__name__}: chi2 {stat:.1f}, critical {chi2_critical(dof):.1f}, dof {dof}")
        assert (stat < chi2_critical(dof)) == should_pass, (verify.__name__, stat, chi2_critical(dof))


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


@pytest.mark.parametrize(
    ("proposer_kind", "params"),
    [
        ("draft", SamplingParams(temperature=1.0)),
        ("draft", SamplingParams(temperature=0.8, top_k=3, top_p=0.9)),
        ("ngram", SamplingParams(temperature=1.0)),
    ],
)
def test_speculative_sampling_matches_the_targets_exact_sequence_distribution(
    monkeypatch, make_tiny_model, proposer_kind, params
):
    # given a 4-token vocabulary: 64 possible 3-token continuations, enumerated exactly
    target_model = make_tiny_model(vocab=4, dim=16, layers=1, seed=3, std=0.6)
    draft_model = make_tiny_model(vocab=4, dim=16, layers=1, seed=4, std=0.9)
    prompt = [0, 1, 2, 3, 0, 1] if proposer_kind == "ngram" else [1, 2]
    exact = exact_sequence_distribution(target_model, prompt, 3, params)
    target = LocalTarget(target_model)
    n = 400  # 64 cells: a wrong sampler shifting a few percent of mass is caught; the right one passes

    def sample_counts() -> torch.Tensor:
        counts = torch.zeros(64)
        for seed in range(n):
            proposer = (
                DraftModelProposer(draft_model, target_vocab_size=4)
                if proposer_kind == "draft"
                else NgramProposer(max_ngram=2)
            )
            config = GenerationConfig(
                max_new_tokens=3, k=2, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed
            )
            a, b, c = generate(target, proposer, prompt, config).tokens
            counts[a * 16 + b * 4 + c] += 1
        return counts

    stat, dof = chi2_statistic(sample_counts(), exact)
    print(f"right sampler: chi2 {stat:.1f}, critical {chi2_critical(dof):.1f}, dof {dof}")
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} >= {chi2_critical(dof):.1f} (dof {dof})"
    # and the same test rejects a wrong sampler
    monkeypatch.setattr(decode_module, "verify_sampled", wrong_verify_sampled)
    stat, dof = chi2_statistic(sample_counts(), exact)
    print(f"wrong sampler: chi2 {stat:.1f}, critical {chi2_critical(dof):.1f}, dof {dof}")
    assert stat >= chi2_critical(dof), f"the wrong sampler passed: chi2 {stat:.1f} (dof {dof})"


def test_same_seed_gives_the_same_tokens_and_another_seed_differs(target_model, draft_model):
    target = LocalTarget(target_model)

    def run(seed: int) -> list[int]:
        proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
        config = GenerationConfig(max_new_tokens=40, k=4, temperature=1.0, top_p=0.95, seed=seed)
        return generate(target, proposer, [1, 2, 3], config).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)
