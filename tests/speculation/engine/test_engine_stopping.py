"""The engine's share of vLLM's stop rules: min_tokens masks the stop tokens; a caller may end the request."""

from __future__ import annotations

from speculation.engine import DraftModelProposer, GenerationConfig, LocalTarget, generate, generate_plain

PROMPT = [1, 2, 3]


def test_min_tokens_keeps_the_stop_tokens_out_of_the_first_tokens_and_speculation_stays_exact(
    target_model, draft_model
):
    target = LocalTarget(target_model)
    plain = generate_plain(target, PROMPT, GenerationConfig(max_new_tokens=40)).tokens
    stop = plain[3]
    first = plain.index(stop)
    # given: a stop token the target produces early; min_tokens past it
    config = GenerationConfig(
        max_new_tokens=40, k=4, stop_token_ids=(stop,), min_tokens=first + 4, suppress_ids=(stop,)
    )
    # when: plain and speculative decoding under the same rule
    want = generate_plain(target, PROMPT, config)
    proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
    got = generate(target, proposer, PROMPT, config)
    # then: no stop token before min_tokens (without the mask it came at `first`), and the same tokens
    assert stop not in want.tokens[: first + 4]
    assert want.tokens[:first] == plain[:first]
    assert got.tokens == want.tokens
    assert got.finish_reason == want.finish_reason


def test_a_caller_that_returns_true_ends_the_request_after_those_tokens(target_model, draft_model):
    target = LocalTarget(target_model)
    plain = generate_plain(target, PROMPT, GenerationConfig(max_new_tokens=40)).tokens
    seen: list[int] = []

    def on_tokens(ids: list[int]) -> bool:
        seen.extend(ids)
        return len(seen) >= 7  # e.g. a stop string matched

    proposer = DraftModelProposer(draft_model, target_vocab_size=target.vocab_size)
    result = generate(target, proposer, PROMPT, GenerationConfig(max_new_tokens=40, k=4), on_tokens=on_tokens)
    assert result.tokens == seen == plain[: len(seen)]
    assert 7 <= len(seen) <= 11  # stopped after the step that reached 7 tokens (a step commits at most K + 1)
    assert result.finish_reason == "stop"
