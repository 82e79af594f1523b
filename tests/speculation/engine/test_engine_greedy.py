"""Greedy speculative decoding emits exactly what plain greedy decoding of the target emits."""

from __future__ import annotations

import pytest
import torch

from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    NgramProposer,
    SuffixIndex,
    SuffixProposer,
    Transformer,
    generate,
    generate_plain,
)

PROMPTS = [[1, 2, 3], [5, 9, 5, 9, 5, 9, 5], [7], [11, 3, 11, 3, 4, 30, 31, 4, 30]]
NEAR_TIE = 1e-4  # a logit gap this small may flip under a different (but equally valid) summation order


def assert_same_or_near_tie(target: Transformer, prompt: list[int], got: list[int], want: list[int]) -> None:
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    tokens = torch.tensor(prompt + want[:i])
    target.setup_cache(target.max_len)
    top2 = target(tokens, 0).logits[-1].topk(2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < NEAR_TIE, f"outputs differ at {i} and the target's top-2 gap there is {gap:.3g} (not a near-tie)"


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("proposer_kind", ["draft", "ngram", "suffix"])
def test_greedy_speculation_is_token_identical_to_plain_greedy(target_model, draft_model, k, proposer_kind):
    target = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=40, k=k)
    index = SuffixIndex()  # suffix decoding: the earlier prompts' answers, with a perturbed copy of each
    for i, prompt in enumerate(PROMPTS):
        proposer = (
            DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
            if proposer_kind == "draft"
            else NgramProposer()
            if proposer_kind == "ngram"
            else SuffixProposer(index)
        )
        want = generate_plain(target, prompt, config).tokens
        result = generate(target, proposer, prompt, config)
        assert len(result.tokens) == 40
        assert_same_or_near_tie(target_model, prompt, result.tokens, want)
        assert result.stats.target_passes < 40 or result.stats.accepted_tokens == 0
        index.add(f"r{i}", want)
        index.add(f"r{i}-perturbed", [(t + 1) % target.vocab_size if j % 5 == 4 else t for j, t in enumerate(want)])


def test_the_draft_proposer_gets_real_acceptance_on_the_test_pair(target_model, draft_model):
    target = LocalTarget(target_model)
    proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
    stats = generate(target, proposer, PROMPTS[0], GenerationConfig(max_new_tokens=60, k=4)).stats
    assert stats.accepted_tokens > 0
    assert stats.target_passes < 60
    assert stats.output_tokens == 60
    assert sum(stats.accepted_length_histogram) == stats.drafts
    assert stats.mean_accepted_len == pytest.approx((stats.accepted_tokens + stats.drafts) / stats.drafts)


@pytest.mark.parametrize("dynamic", [False, True])
def test_dynamic_k_keeps_greedy_output_identical(target_model, draft_model, dynamic):
    target = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=50, k=6, dynamic_k=dynamic)
    want = generate_plain(target, PROMPTS[3], config).tokens
    proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
    result = generate(target, proposer, PROMPTS[3], config)
    assert_same_or_near_tie(target_model, PROMPTS[3], result.tokens, want)
    assert all(0 <= k <= 6 for k in result.k_history)
    assert result.stats.drafted_tokens <= 6 * result.stats.drafts


def test_stop_token_inside_a_draft_ends_the_output_there(target_model, draft_model):
    target = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=40, k=5)
    plain = generate_plain(target, PROMPTS[0], config).tokens
    stop = plain[12]
    first = plain.index(stop)
    chunks: list[list[int]] = []
    proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
    result = generate(
        target,
        proposer,
        PROMPTS[0],
        GenerationConfig(max_new_tokens=40, k=5, stop_token_ids=(stop,)),
        on_tokens=chunks.append,
    )
    assert result.tokens == plain[: first + 1]
    assert result.finish_reason == "stop"
    assert [t for chunk in chunks for t in chunk] == result.tokens
    assert result.stats.output_tokens == first + 1


def test_context_limit_stops_generation_at_the_context_end(target_model, draft_model):
    target = LocalTarget(target_model)
    proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
    result = generate(target, proposer, PROMPTS[1], GenerationConfig(max_new_tokens=100, k=5, max_context=20))
    assert len(PROMPTS[1]) + len(result.tokens) == 20
    assert result.finish_reason == "length"
    plain = generate_plain(target, PROMPTS[1], GenerationConfig(max_new_tokens=13)).tokens
    assert result.tokens == plain


def test_streaming_callback_receives_every_committed_chunk_in_order(target_model):
    target = LocalTarget(target_model)
    chunks: list[list[int]] = []
    result = generate(
        target, NgramProposer(), PROMPTS[1], GenerationConfig(max_new_tokens=30, k=4), on_tokens=chunks.append
    )
    assert [t for chunk in chunks for t in chunk] == result.tokens
    assert len(chunks) == result.stats.target_passes
    assert all(1 <= len(chunk) <= 5 for chunk in chunks)
