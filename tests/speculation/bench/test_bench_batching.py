"""`python -m speculation.bench.batching`'s batched runs: each variant's outputs are plain decoding's, and the
lookup variants draft from the store they are given (the figures in docs/BENCHMARKS.md rest on these counts)."""

from __future__ import annotations

import pytest

from speculation.bench.batching import VARIANTS, run_batched, run_sequential
from speculation.engine import GenerationConfig, LocalTarget, SuffixIndex, generate_plain
from tests.support.models import draft_of, tiny_model

PROMPTS = [[1, 2, 3], [5, 6, 7, 8], [9, 4, 4, 2, 30], [11, 12]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(seed=0)
    return target, draft_of(target)


def test_every_variant_answers_as_plain_decoding_alone_and_the_hybrid_uses_both_drafters(pair):
    target, draft = pair
    # given a store holding the target's answers to two of the prompts (earlier traffic)
    store = SuffixIndex()
    for i in (0, 2):
        store.add(f"earlier{i}", generate_plain(LocalTarget(target), PROMPTS[i], GenerationConfig(24)).tokens)
    plain = run_sequential(target, None, PROMPTS, 24)["outputs"]
    # when every variant serves the four prompts at once
    runs = {variant: run_batched(target, draft, PROMPTS, variant, 24, store=store) for variant in VARIANTS}
    # then each answers as plain decoding does, token for token
    for variant, run in runs.items():
        assert run["outputs"] == plain, variant
        assert run["tokens"] == 4 * 24
    # and the lookups drafted from the store: all of suffix decoding's drafts, part of the hybrid's
    assert runs["suffix"]["looked_up_tokens"] == 0 < runs["suffix"]["drafted_tokens"]  # no model: not "looked up"
    hybrid = runs["hybrid"]
    assert 0 < hybrid["looked_up_tokens"] < hybrid["drafted_tokens"]
    assert runs["plain"]["drafted_tokens"] == 0
