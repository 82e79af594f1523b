"""Prefix caching in the batch decoder: a request that starts with tokens a finished request had prefills only the rest,
and decodes exactly what it decodes alone.

Equalities (no tolerance; the tiny models' logits are decisive, so the 1e-6 of another prefill split flips no
argmax): greedy tokens equal plain decoding alone; a seeded sampled request draws what generate() draws with that
seed (so the draft model's reused row is exact too: its distributions decide the draws); drafted and accepted counts
equal generate()'s at the same K.
"""

from __future__ import annotations

import torch

from speculation.engine import DraftModelProposer, GenerationConfig, LocalTarget, generate, generate_plain
from speculation.engine.batch import BatchDecoder
from speculation.engine.prefix_cache import PrefixCache

BASE = [(3 * i + 1) % 47 + 1 for i in range(24)]


def decoder(target_model, draft_model, cache: PrefixCache | None) -> BatchDecoder:
    return BatchDecoder(target_model, slots=2, draft=draft_model, max_context=target_model.max_len, prefix_cache=cache)


def alone(decoder_: BatchDecoder, prompt: list[int], config: GenerationConfig):
    """Run one request to its end; -> its tokens and stats."""
    decoder_.add("r", prompt, config)
    tokens, stats = [], None
    for _ in range(200):
        for update in decoder_.step():
            tokens += update.tokens
            if update.finish_reason:
                return tokens, update.stats
    raise AssertionError(f"never finished ({stats})")


def reference(target_model, draft_model, prompt, config):
    proposer = DraftModelProposer(draft_model, target_vocab_size=target_model.vocab_size)
    return generate(LocalTarget(target_model), proposer, prompt, config)


def test_repeated_diverging_and_next_turn_prompts_reuse_the_cache_and_decode_exactly(target_model, draft_model):
    cache = PrefixCache(1 << 24)
    batch = decoder(target_model, draft_model, cache)
    config = GenerationConfig(max_new_tokens=30, k=3)
    first, stats = alone(batch, BASE, config)
    assert stats.cached_prompt_tokens == 0 and len(cache) == 1
    prompts = {
        "same prompt": (BASE, len(BASE) - 1),
        "diverges after 20": (BASE[:20] + [7, 7, 9, 9, 11], 20),
        "next turn (prompt, answer, more)": (BASE + first[:10] + [5, 6], len(BASE) + 10),
        "unrelated": ([40, 41, 42, 43] * 6, 0),
        "shares fewer than 16": (BASE[:12] + [8] * 12, 0),
    }
    for name, (prompt, cached) in prompts.items():
        tokens, stats = alone(batch, prompt, config)
        expected = reference(target_model, draft_model, prompt, config)
        assert tokens == expected.tokens == generate_plain(LocalTarget(target_model), prompt, config).tokens, name
        assert stats.cached_prompt_tokens == cached, name
        # the draft's row was reused exactly too: it proposed and had accepted what it does alone
        assert (stats.drafted_tokens, stats.accepted_tokens) == (
            expected.stats.drafted_tokens,
            expected.stats.accepted_tokens,
        ), name
    assert cache.hits == 3 and cache.lookups == 6


def test_a_seeded_sampled_request_draws_what_it_draws_alone_from_a_cached_prefix(target_model, draft_model):
    batch = decoder(target_model, draft_model, PrefixCache(1 << 24))
    alone(batch, BASE + [9, 9], GenerationConfig(max_new_tokens=12, k=3))
    config = GenerationConfig(max_new_tokens=30, k=3, temperature=0.8, top_p=0.9, seed=11)
    tokens, stats = alone(batch, BASE + [5], config)
    assert stats.cached_prompt_tokens == len(BASE)
    assert tokens == reference(target_model, draft_model, BASE + [5], config).tokens


def test_without_a_cache_nothing_is_reused(target_model, draft_model):
    batch = decoder(target_model, draft_model, None)
    config = GenerationConfig(max_new_tokens=8, k=2)
    alone(batch, BASE, config)
    tokens, stats = alone(batch, BASE, config)
    assert stats.cached_prompt_tokens == 0
    assert tokens == generate_plain(LocalTarget(target_model), BASE, config).tokens


def rows(length: int, width: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, length, width), torch.zeros(1, length, width))]  # 32 bytes per position


def test_the_cache_keeps_the_longest_rows_within_its_budget_least_recently_used_first():
    cache = PrefixCache(32 * 100, min_match=4)  # room for 100 positions
    a, b, c = list(range(1, 41)), list(range(100, 140)), list(range(200, 240))
    assert cache.put(a[:20], rows(20), None, 0)
    assert cache.put(a, rows(40), None, 0)  # extends the first: replaces it
    assert len(cache) == 1 and cache.bytes == 32 * 40
    assert not cache.put(a[:30], rows(30), None, 0)  # already held by a longer row
    assert cache.put(b, rows(40), None, 0)
    assert cache.match(a + [1, 2]).common == 40  # a is now the most recent
    assert cache.put(c, rows(40), None, 0)  # over budget: b, the least recent, goes
    assert cache.match(b) is None and cache.match(a).common == 40 and cache.match(c[:10] + [0]).common == 10
    assert not cache.put([1, 2, 3], rows(3), None, 0)  # shorter than min_match
    assert not cache.put(list(range(500, 700)), rows(200), None, 0)  # bigger than the whole budget
    assert cache.match(a[:3] + [0] * 10) is None  # 3 tokens in common < min_match
    hit = cache.match(a)
    assert hit.reusable(len(a)) == 39 and hit.reusable(len(a), draft=True) == 0  # the last token is fed, no draft row
