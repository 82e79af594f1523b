"""Replays of sampled requests (speculation.engine.replay): a lookup's replay against the sampled output is exact
run by run, and ``expected_hybrid`` (the hybrid's, or a draft model's, expected counts given the sampled output) is
the mean of the real sampled runs."""

from __future__ import annotations

import math

import pytest
import torch

from speculation.engine import (
    HYBRID_LOOKUP_K,
    HYBRID_MIN_LOOKUP,
    DraftModelProposer,
    GenerationConfig,
    HybridProposer,
    LocalTarget,
    NgramProposer,
    SuffixIndex,
    SuffixProposer,
    draft_greedy_predictions,
    expected_hybrid,
    generate,
    replay_proposer,
    teacher_forced,
)
from speculation.engine.sampling import SamplingParams, probs_from_logits

PROMPT = [5, 9, 5, 9, 5, 9, 5]
TEMPERATURE, TOP_P = 0.8, 0.95


def _sampled(seed: int, max_new_tokens: int = 40, k: int = 4) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=max_new_tokens, k=k, temperature=TEMPERATURE, top_p=TOP_P, seed=seed, fixed_k=True
    )


def _store(target: LocalTarget, seeds: range) -> SuffixIndex:
    """Earlier sampled answers to the same prompt: what a warm endpoint's suffix store holds."""
    index = SuffixIndex()
    for seed in seeds:
        index.add(f"earlier{seed}", generate(target, None, PROMPT, _sampled(seed)).tokens)
    return index


@pytest.mark.parametrize("lookup", ["ngram", "suffix"])
def test_a_lookups_replay_against_the_sampled_output_is_the_run(target_model, lookup):
    # a one-hot draft token passes with probability p(d); rejected, the token comes from p without d: the step's
    # token equals the draft exactly when it passed, so replaying against the sampled output gives the run's counts
    target = LocalTarget(target_model)
    index = _store(target, range(100, 104))
    looked_up = 0
    for seed in range(12):
        proposer = NgramProposer() if lookup == "ngram" else SuffixProposer(index)
        live = generate(target, proposer, PROMPT, _sampled(seed, k=5))
        sequence = PROMPT + live.tokens
        replayed = replay_proposer(proposer, sequence, 5, prompt_len=len(PROMPT), max_new_tokens=40)
        assert replayed.counts() == live.stats.counts()
        looked_up += live.stats.drafted_tokens
    assert looked_up > 0  # the lookups drafted (else the comparison says nothing)


def _passes(target_model, draft_model, sequence: list[int], prompt_len: int) -> list[float]:
    """min(1, q(o) / p(o)) at each output position: the draft's probability of passing given the sampled token."""
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    ids = torch.tensor(sequence[:-1])
    p = probs_from_logits(target_model(ids, 0).logits[prompt_len - 1 :].float(), params)
    q = probs_from_logits(draft_model(ids, 0).logits[prompt_len - 1 :].float(), params)
    rows, tokens = torch.arange(p.shape[0]), torch.tensor(sequence[prompt_len:])
    return torch.clamp(q[rows, tokens] / p[rows, tokens], max=1.0).tolist()


def test_with_certain_passes_it_is_the_greedy_replay(target_model, draft_model):
    # greedy drafts pass exactly where the draft's prediction is the output's token: probabilities 0 and 1
    target = LocalTarget(target_model)
    index = _store(target, range(100, 103))
    for prompt in (PROMPT, [11, 3, 11, 3, 4, 30]):
        sequence = prompt + generate(target, None, prompt, GenerationConfig(max_new_tokens=37)).tokens
        predictions = draft_greedy_predictions(draft_model, sequence)
        passes = [float(predictions[i - 1] == sequence[i]) for i in range(len(prompt), len(sequence))]
        for model_k in (1, 3, 5):
            hybrid = HybridProposer(SuffixProposer(index), teacher_forced(predictions), model_k=model_k)
            want = replay_proposer(hybrid, sequence, HYBRID_LOOKUP_K, prompt_len=len(prompt), max_new_tokens=37)
            got = expected_hybrid(
                lambda n, d, s=sequence: SuffixProposer(index).lookup(s[:n], d),
                passes,
                sequence,
                model_k,
                prompt_len=len(prompt),
                lookup_k=HYBRID_LOOKUP_K,
                min_lookup=HYBRID_MIN_LOOKUP,
                max_new_tokens=37,
            )
            assert _flat(got.counts()) == pytest.approx(_flat(want.counts()))


def _flat(counts: dict) -> dict:
    """The counts with each per-position list's entries as keys of their own (the lists' widths differ)."""
    flat = {}
    for name, value in counts.items():
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if v or not isinstance(value, list):
                flat[f"{name}[{i}]"] = v
    return flat


@pytest.mark.parametrize("with_store", [False, True])
def test_the_expected_counts_are_the_mean_of_the_sampled_runs(target_model, draft_model, with_store):
    """E[passes | output] from expected_hybrid, averaged over real sampled runs, against those runs' own passes.
    Given the output each draft position passes independently with probability min(1, q(o)/p(o)), so the expected
    counts are exact in expectation: their mean differs from the runs' by sampling noise only. Tolerance: 4
    standard errors of the per-run difference (a false alarm about 1 in 16 000 runs of this test). The average
    acceptance sum_x min(p, q) in place of the per-token probability is what the record would get without the
    sampled tokens' own probabilities; it is reported in the assertion message for comparison."""
    target = LocalTarget(target_model)
    index = _store(target, range(200, 206))
    # without the store: a lookup is never taken (it could find at most 8 tokens), the draft model drafts alone
    min_lookup = HYBRID_MIN_LOOKUP if with_store else HYBRID_LOOKUP_K + 1
    model_k, runs = 3, 160
    differences, accepted_differences, looked_up, drafted = [], [], 0.0, 0.0
    for seed in range(runs):
        draft = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
        proposer = HybridProposer(SuffixProposer(index), draft, model_k=model_k, min_lookup=min_lookup)
        run = generate(target, proposer, PROMPT, _sampled(seed, k=HYBRID_LOOKUP_K))
        live, sequence = run.stats, PROMPT + run.tokens
        expected = expected_hybrid(
            lambda n, d, s=sequence: SuffixProposer(index).lookup(s[:n], d),
            _passes(target_model, draft_model, sequence, len(PROMPT)),
            sequence,
            model_k,
            prompt_len=len(PROMPT),
            lookup_k=HYBRID_LOOKUP_K,
            min_lookup=min_lookup,
            max_new_tokens=40,
        )
        differences.append(live.target_passes - expected.target_passes)
        accepted_differences.append(live.accepted_tokens - expected.accepted_tokens)
        looked_up += expected.looked_up_tokens
        drafted += expected.drafted_tokens - expected.looked_up_tokens
    assert drafted > 0 and (looked_up > 0) == with_store  # both drafters' steps were exercised
    for name, values in (("target passes", differences), ("accepted tokens", accepted_differences)):
        mean = sum(values) / runs
        se = math.sqrt(sum((v - mean) ** 2 for v in values) / (runs - 1) / runs)
        assert abs(mean) <= 4 * se + 1e-9, f"{name}: mean difference {mean:.3f} over {runs} runs, se {se:.3f}"


@pytest.fixture(scope="module")
def trained_head(target_model, tmp_path_factory):
    """An EAGLE head trained briefly on the target's own continuations (its drafts often pass)."""
    from tests.support.eagle import head_for, trained_head

    return trained_head(target_model, head_for(target_model), tmp_path_factory.mktemp("sampled-chain-head"))


def test_an_eagle_heads_sampled_chain_is_expected_as_the_mean_of_its_runs(target_model, trained_head):
    """A head's chain drafts from the target's features at the step's start, so its j-th draft's probability of
    passing depends on where the step started: min(1, q(o)/p(o)) with q the head's chain after the sampled tokens
    (chain_logits_along). Averaged over real sampled runs the expected passes equal the runs' within 4 standard
    errors (as above)."""
    from speculation.engine.eagle import EagleProposer, chain_logits_along

    target = LocalTarget(target_model)
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P)
    k, runs = 4, 120
    differences, accepted = [], 0
    for seed in range(runs):
        run = generate(target, EagleProposer(trained_head, target_model), PROMPT, _sampled(seed, k=k))
        sequence, n = PROMPT + run.tokens, len(run.tokens)
        with torch.inference_mode():
            hidden = target_model(torch.tensor(sequence), 0, return_hidden=True).hidden
            p = probs_from_logits(target_model(torch.tensor(sequence[:-1]), 0).logits[len(PROMPT) - 1 :], params)
        chains = []
        for i, logits in enumerate(
            chain_logits_along(trained_head, target_model, sequence, hidden, prompt_len=len(PROMPT), depth=k)
        ):
            q = probs_from_logits(logits.float(), params)
            tokens = sequence[len(PROMPT) + i : len(PROMPT) + i + q.shape[0]]
            chains.append([min(1.0, float(q[j, t] / p[i + j, t])) for j, t in enumerate(tokens)])
        expected = expected_hybrid(
            None, [0.0] * n, sequence, k, prompt_len=len(PROMPT), lookup_k=k, min_lookup=1, max_new_tokens=40,
            chains=chains,
        )  # fmt: skip
        differences.append(run.stats.target_passes - expected.target_passes)
        accepted += run.stats.accepted_tokens
    assert accepted > 0
    mean = sum(differences) / runs
    se = math.sqrt(sum((v - mean) ** 2 for v in differences) / (runs - 1) / runs)
    assert abs(mean) <= 4 * se + 1e-9, f"mean difference {mean:.3f} over {runs} runs, se {se:.3f}"
