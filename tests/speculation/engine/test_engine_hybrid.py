"""Suffix decoding with a draft model's fallback (speculation.engine.proposers.HybridProposer): exact, both drafters
really used, the draft's cache right after the steps the lookup served, and the shadow replay equal to the run."""

from __future__ import annotations

import pytest

from speculation.engine import (
    HYBRID_LOOKUP_K,
    DraftModelProposer,
    GenerationConfig,
    HybridProposer,
    KnownDrafts,
    LocalTarget,
    NgramProposer,
    SuffixIndex,
    SuffixProposer,
    draft_greedy_predictions,
    generate,
    replay_proposer,
    teacher_forced,
)
from speculation.engine.projection import StepCosts

PROMPTS = [[1, 2, 3], [5, 9, 5, 9, 5, 9, 5], [7], [11, 3, 11, 3, 4, 30, 31, 4, 30]]


def _store(target, prompts, tokens=40) -> SuffixIndex:
    """The target's own answers to these prompts: what a warm endpoint's store holds."""
    index = SuffixIndex()
    for i, prompt in enumerate(prompts):
        index.add(f"earlier{i}", generate(target, None, prompt, GenerationConfig(max_new_tokens=tokens)).tokens)
    return index


def _hybrid(index, draft_model, vocab, model_k, min_lookup=3) -> HybridProposer:
    draft = DraftModelProposer(draft_model, target_vocab_size=vocab)
    return HybridProposer(SuffixProposer(index), draft, model_k=model_k, min_lookup=min_lookup)


def test_greedy_output_is_the_targets_and_both_drafters_draft(target_model, draft_model):
    # given a store holding the target's answer to one prompt, and a second prompt it has never seen
    target = LocalTarget(target_model)
    index = _store(target, [[1, 2, 3]])
    for prompt in ([1, 2, 3], [11, 3, 11, 3, 4, 30]):
        plain = generate(target, None, prompt, GenerationConfig(max_new_tokens=40)).tokens
        # when the hybrid speculates (the lookup may draft up to 8, the draft model 2)
        proposer = _hybrid(index, draft_model, target.vocab_size, model_k=2)
        result = generate(target, proposer, prompt, GenerationConfig(max_new_tokens=40, k=HYBRID_LOOKUP_K))
        # then the output is plain decoding's, token for token
        assert result.tokens == plain
    # and on the repeated prompt the lookup served long drafts while the draft model drafted where it found little
    repeated = generate(
        target,
        _hybrid(index, draft_model, target.vocab_size, model_k=2),
        [1, 2, 3],
        GenerationConfig(max_new_tokens=40, k=HYBRID_LOOKUP_K),
    ).stats
    assert repeated.looked_up_tokens > 0
    assert repeated.looked_up_tokens >= 0.5 * repeated.drafted_tokens
    fresh = generate(
        target,
        _hybrid(SuffixIndex(), draft_model, target.vocab_size, model_k=2),
        [11, 3, 11, 3, 4, 30],
        GenerationConfig(max_new_tokens=40, k=HYBRID_LOOKUP_K),
    ).stats
    assert fresh.drafted_tokens > fresh.looked_up_tokens  # the model drafted
    # the model never drafts past its own K: every step it drafted carried at most 2
    assert all(n == 0 for n in fresh.drafted_per_position[HYBRID_LOOKUP_K:])


@pytest.mark.parametrize("model_k", [1, 3, 5])
@pytest.mark.parametrize("min_lookup", [1, 3])
def test_the_shadow_replay_gives_the_same_stats_as_the_run(target_model, draft_model, model_k, min_lookup):
    # a stale draft cache after steps the lookup served would draft differently from the teacher-forced replay
    target = LocalTarget(target_model)
    index = _store(target, PROMPTS[:2])
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=37, k=HYBRID_LOOKUP_K)
        live = generate(target, _hybrid(index, draft_model, target.vocab_size, model_k, min_lookup), prompt, config)
        sequence = prompt + live.tokens
        model = teacher_forced(draft_greedy_predictions(draft_model, sequence))
        replayed = replay_proposer(
            HybridProposer(SuffixProposer(index), model, model_k=model_k, min_lookup=min_lookup),
            sequence,
            HYBRID_LOOKUP_K,
            prompt_len=len(prompt),
            max_new_tokens=37,
        )
        assert replayed.counts() == live.stats.counts()


def test_a_lookup_shorter_than_min_lookup_goes_to_the_model():
    index = SuffixIndex()
    index.add("a", [1, 2, 3, 4, 5, 6])
    calls = []

    def model(n: int, d: int) -> list[int]:
        calls.append(d)
        return [9] * d

    proposer = HybridProposer(SuffixProposer(index), KnownDrafts(model), model_k=2, min_lookup=3)
    from speculation.engine import SamplingParams

    greedy = SamplingParams()
    # "1 2" matched: up to 2 x 2 tokens follow, looked up
    looked = proposer.propose([1, 2], 8, greedy, None)
    assert looked.tokens.tolist() == [3, 4, 5, 6] and looked.looked_up and calls == []
    # "5" matched (one token, so at most 2 follow): only "6" follows, too little: the model drafts its K
    fell = proposer.propose([0, 5], 8, greedy, None)
    assert fell.tokens.tolist() == [9, 9] and not fell.looked_up and calls == [2]
    assert proposer.propose([0, 5], 1, greedy, None).tokens.tolist() == [9]  # within the step's budget


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="model_k"):
        HybridProposer(NgramProposer(), KnownDrafts(lambda n, d: []), model_k=0)
    with pytest.raises(ValueError, match="min_lookup"):
        HybridProposer(NgramProposer(), KnownDrafts(lambda n, d: []), model_k=2, min_lookup=0)


def test_the_projection_charges_the_draft_step_for_the_models_drafts_only():
    costs = StepCosts(target_step_s=1.0, draft_step_s=0.2, verify_s={1: 1.0, 9: 1.4})
    # 4 drafts per verification, all of them the model's: v(4) + 4 c; one of them the model's: v(4) + 1 c
    assert costs.multiplier(tokens_per_step=3.0, k=4) == pytest.approx(3.0 / (1.2 + 0.8))
    assert costs.multiplier(tokens_per_step=3.0, k=4, draft_steps=1.0) == pytest.approx(3.0 / (1.2 + 0.2))


def test_the_batch_engine_drafts_with_a_draft_model_a_lookup_or_both_and_nothing_else(draft_model):
    from speculation.engine.proposers import BatchForm, batch_form

    draft = DraftModelProposer(draft_model, target_vocab_size=draft_model.vocab_size)
    lookup = SuffixProposer()
    assert batch_form(draft) == BatchForm(draft=draft_model, width=draft.width)
    assert batch_form(lookup) == BatchForm(lookup=lookup)
    assert batch_form(HybridProposer(lookup, draft, model_k=2)) == BatchForm(
        draft=draft_model, width=draft.width, lookup=lookup
    )
    assert batch_form(HybridProposer(lookup, NgramProposer(), model_k=2)) is None  # a lookup's fallback
    assert batch_form(object()) is None  # an EAGLE head, plain decoding: batch one
    draft_model.implementation = "generic"  # a model transformers runs: its own cache, batch one
    try:
        assert batch_form(draft) is None
    finally:
        del draft_model.implementation


def test_the_loop_k_of_a_hybrid_is_its_lookup_cap_and_its_model_k_the_policys(draft_model):
    from speculation.engine.proposers import loop_k

    draft = DraftModelProposer(draft_model, target_vocab_size=draft_model.vocab_size)
    hybrid = HybridProposer(SuffixProposer(), draft, model_k=5)
    assert loop_k(hybrid, 2) == HYBRID_LOOKUP_K and hybrid.model_k == 2
    assert loop_k(draft, 3) == 3
    assert loop_k(hybrid, 0) == 0  # plain steps stay plain
