"""The shadow replay reproduces greedy speculation's stats exactly, from one teacher-forced draft pass."""

from __future__ import annotations

import pytest
import torch

from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    draft_greedy_predictions,
    expected_acceptance,
    generate,
    replay_greedy,
)

PROMPTS = [[1, 2, 3], [5, 9, 5, 9, 5, 9, 5], [7], [11, 3, 11, 3, 4, 30, 31, 4, 30]]


@pytest.mark.parametrize("k", [1, 2, 5, 16])
def test_replay_gives_the_same_stats_as_generate(target_model, draft_model, k):
    target = LocalTarget(target_model)
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=37, k=k)
        proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
        result = generate(target, proposer, prompt, config)
        sequence = prompt + result.tokens
        replayed = replay_greedy(
            draft_greedy_predictions(draft_model, sequence), sequence, k, prompt_len=len(prompt), max_new_tokens=37
        )
        assert replayed.counts() == result.stats.counts()


def test_replay_matches_generate_when_a_stop_token_or_the_context_ends_the_output(target_model, draft_model):
    target = LocalTarget(target_model)
    prompt = PROMPTS[0]
    plain = generate(target, None, prompt, GenerationConfig(max_new_tokens=40)).tokens
    cases = [GenerationConfig(max_new_tokens=40, k=5, stop_token_ids=(plain[t],)) for t in (3, 10, 25)]
    cases.append(GenerationConfig(max_new_tokens=100, k=5, max_context=30))
    for config in cases:
        proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
        result = generate(target, proposer, prompt, config)
        sequence = prompt + result.tokens
        replayed = replay_greedy(
            draft_greedy_predictions(draft_model, sequence),
            sequence,
            config.k,
            prompt_len=len(prompt),
            max_new_tokens=config.max_new_tokens,
            max_context=config.max_context,
        )
        assert replayed.counts() == result.stats.counts(), config


def test_replay_counts_a_hand_worked_example():
    # prompt [0], output [1, 2, 3, 4, 5]; the draft predicts 1, 2, then 9 (wrong), then 4, 5
    target_tokens = [0, 1, 2, 3, 4, 5]
    draft_next = [1, 2, 9, 4, 5]
    stats = replay_greedy(draft_next, target_tokens, 3, prompt_len=1)
    # step 1 at n=1: k=3, drafts 1,2,9 -> accepts 2, commits 1,2,3; step 2 at n=4: k=min(3, 5-3-1)=1, accepts 4,
    # commits 4,5 (bonus)
    assert stats.counts() == {
        "drafts": 2,
        "drafted_tokens": 4,
        "looked_up_tokens": 0,  # no hybrid: no draft came from a lookup
        "accepted_tokens": 3,
        "accepted_per_position": [2, 1, 0],
        "drafted_per_position": [2, 1, 1],
        "reached_per_position": [2, 1, 1],
        "accepted_length_histogram": [0, 1, 1, 0],
        "target_passes": 2,
        "output_tokens": 5,
    }
    assert stats.acceptance_rate == pytest.approx(3 / 4)
    assert stats.alpha == pytest.approx(3 / 4)
    assert stats.mean_accepted_len == pytest.approx(2.5)


def test_expected_acceptance_is_the_overlap_of_p_and_q():
    q = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    target = [{0: torch.tensor(0.2).log().item(), 1: torch.tensor(0.8).log().item()}, {2: 0.0}]
    # position 0: min(.2,.5) + min(.8,.5) = 0.7; position 1: p is all on token 2, q on token 0 -> 0
    assert expected_acceptance(target, q) == pytest.approx(0.35)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_replaying_ngram_lookup_gives_the_same_stats_as_generate_with_it(target_model, k):
    # n-gram drafts are a function of the committed tokens, so a replay from the known output is exact
    from speculation.engine import NgramProposer
    from speculation.engine.replay import replay_proposals

    target = LocalTarget(target_model)
    lookup = NgramProposer()
    for prompt in PROMPTS:
        result = generate(target, NgramProposer(), prompt, GenerationConfig(max_new_tokens=37, k=k))
        sequence = prompt + result.tokens
        replayed = replay_proposals(
            lambda n, d, seq=sequence: lookup.lookup(seq[:n], d), sequence, k, prompt_len=len(prompt), max_new_tokens=37
        )
        assert replayed.counts() == result.stats.counts()


def test_an_eagle_head_replays_through_the_same_loop_with_the_targets_features():
    # given a 4-token target (drafts often match) and an untrained EAGLE head for it
    from speculation.engine import replay_proposer
    from speculation.engine.eagle import EagleConfig, EagleHead, EagleProposer, init_weights
    from tests.support.models import tiny_model

    model = tiny_model(vocab=4, seed=3)
    config = EagleConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=4, max_position_embeddings=256)  # fmt: skip
    head = EagleHead(config)
    init_weights(head, torch.Generator().manual_seed(0))
    for prompt in PROMPTS:
        prompt = [t % 4 for t in prompt]
        result = generate(LocalTarget(model), EagleProposer(head, model), prompt, GenerationConfig(30, k=3))
        sequence = prompt + result.tokens
        with torch.inference_mode():
            hidden = model(torch.tensor(sequence), 0, return_hidden=True).hidden  # one teacher-forced pass
        # when: the same head replays the finished request on a ReplayTarget holding the target's features
        replayed = replay_proposer(EagleProposer(head, model), sequence, 3, prompt_len=len(prompt), hidden=hidden)
        # then: the same steps, counted alike
        assert replayed.counts() == result.stats.counts()
        assert result.stats.accepted_tokens > 0  # a 4-token vocabulary: the head's drafts are often accepted
