"""Speculative sampling is distributed exactly as the target's (processed) distribution, and is seeded.

Statistical tests: Pearson chi-square of sampled counts against the exact distribution, rejecting at
p < 1e-3 (critical value from the chi-square quantile; the false-alarm rate per test is 0.1 %). Each test
runs the same check on a deliberately wrong sampler (recovered token drawn from p instead of
norm(max(0, p - q))) and requires it to be rejected, so the check has power at its sample size.
"""

from __future__ import annotations

import pytest
import torch

from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    HybridProposer,
    LocalTarget,
    NgramProposer,
    SamplingParams,
    SuffixIndex,
    SuffixProposer,
    generate,
    verify_sampled,
)
from speculation.engine import batch as step_module
from tests.support.stats import chi2_critical, chi2_statistic, exact_sequence_distribution, wrong_verify_sampled


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


@pytest.mark.parametrize(
    ("proposer_kind", "params"),
    [
        ("draft", SamplingParams(temperature=1.0)),
        ("draft", SamplingParams(temperature=0.8, top_k=3, top_p=0.9)),
        ("ngram", SamplingParams(temperature=1.0)),
        ("suffix", SamplingParams(temperature=1.0)),
        ("hybrid", SamplingParams(temperature=0.8, top_k=3, top_p=0.9)),
    ],
)
def test_speculative_sampling_matches_the_targets_exact_sequence_distribution(
    monkeypatch, make_tiny_model, proposer_kind, params
):
    # given a 4-token vocabulary: 64 possible 3-token continuations, enumerated exactly
    target_model = make_tiny_model(vocab=4, dim=16, layers=1, seed=3, std=0.6)
    draft_model = make_tiny_model(vocab=4, dim=16, layers=1, seed=4, std=0.9)
    prompt = [0, 1, 2, 3, 0, 1] if proposer_kind == "ngram" else [1, 2]
    index = SuffixIndex()  # earlier "responses" that continue the prompt's last token in different ways
    for i, earlier in enumerate([[2, 3, 3, 1], [2, 3, 0, 0], [1, 2, 0, 3, 1], [2, 1, 1, 2]]):
        index.add(f"r{i}", earlier)
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
                if proposer_kind == "ngram"
                else SuffixProposer(index)
            )
            if proposer_kind == "hybrid":  # the store's drafts where 2 tokens are found, else the draft model's
                draft = DraftModelProposer(draft_model, target_vocab_size=4)
                proposer = HybridProposer(proposer, draft, model_k=2, min_lookup=2)
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
    monkeypatch.setattr(step_module, "verify_sampled", wrong_verify_sampled)
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
