"""Bad input is refused with a SpecDecodeError subclass and a message, never answered silently wrong."""

from __future__ import annotations

import pytest

from speculation.engine import (
    ContextLengthError,
    DraftModelProposer,
    EmptyPromptError,
    GenerationConfig,
    LocalTarget,
    LookaheadError,
    NgramProposer,
    SamplingParamError,
    SpecDecodeError,
    VocabMismatchError,
    generate,
    generate_plain,
    replay_greedy,
)


def test_empty_prompt_is_refused(target_model):
    with pytest.raises(EmptyPromptError, match="no tokens"):
        generate(LocalTarget(target_model), NgramProposer(), [], GenerationConfig())


@pytest.mark.parametrize("k", [-1, 17, 100])
def test_lookahead_outside_1_to_16_is_refused(k):
    with pytest.raises(LookaheadError, match=r"\[1, 16\]"):
        GenerationConfig(k=k)
    with pytest.raises(LookaheadError):
        replay_greedy([1, 2], [1, 2, 3], k, prompt_len=1)


def test_k_0_is_plain_decoding_through_the_same_loop(target_model, draft_model):
    with pytest.raises(LookaheadError):
        replay_greedy([1, 2], [1, 2, 3], 0, prompt_len=1)  # a replay needs drafts
    prompt, config = [3, 1, 4, 1, 5], GenerationConfig(k=0, max_new_tokens=10)
    proposer = DraftModelProposer(draft_model, target_vocab_size=target_model.vocab_size)
    result = generate(LocalTarget(target_model), proposer, prompt, config)
    assert result.stats.drafted_tokens == 0 and result.stats.target_passes == 10
    assert result.tokens == generate_plain(LocalTarget(target_model), prompt, config).tokens


@pytest.mark.parametrize("temperature", [-0.1, float("nan")])
def test_negative_temperature_is_refused(temperature):
    with pytest.raises(SamplingParamError, match="temperature"):
        GenerationConfig(temperature=temperature)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01])
def test_top_p_outside_0_1_is_refused(top_p):
    with pytest.raises(SamplingParamError, match="top_p"):
        GenerationConfig(temperature=1.0, top_p=top_p)


def test_draft_with_another_vocabulary_is_refused(target_model, make_tiny_model):
    other = make_tiny_model(vocab=target_model.vocab_size + 1)
    with pytest.raises(VocabMismatchError, match="vocabulary"):
        DraftModelProposer(other, target_vocab_size=target_model.vocab_size)


def test_prompt_longer_than_the_context_is_refused(target_model):
    target = LocalTarget(target_model)
    with pytest.raises(ContextLengthError, match="context"):
        generate(target, NgramProposer(), [1] * 21, GenerationConfig(max_context=20))
    with pytest.raises(ContextLengthError):
        generate(target, None, [1] * (target.max_context + 1), GenerationConfig())


def test_token_ids_outside_the_vocabulary_are_refused(target_model):
    with pytest.raises(VocabMismatchError):
        generate(LocalTarget(target_model), None, [target_model.vocab_size], GenerationConfig())


def test_every_input_error_is_a_value_error():
    for error in (EmptyPromptError, LookaheadError, SamplingParamError, VocabMismatchError, ContextLengthError):
        assert issubclass(error, SpecDecodeError)
        assert issubclass(error, ValueError)
