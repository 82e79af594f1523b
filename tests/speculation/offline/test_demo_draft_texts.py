"""The drafts' own, wider text budgets (``Recipe.draft_train_bytes`` / ``draft_prose_bytes``, demo-v9 on)."""

from __future__ import annotations

from dataclasses import replace

from speculation.offline.demo import build as demo_build
from speculation.offline.demo.corpus import stdlib_corpus
from speculation.offline.demo.recipes import RECIPES
from speculation.offline.demo.tokenizer import train_tokenizer


def _texts(recipe, tokenizer, corpus):
    return demo_build._texts(corpus, tokenizer, recipe, corpus.train_text(recipe.train_bytes))


def test_the_drafts_text_is_the_targets_without_budgets_of_their_own():
    corpus = stdlib_corpus()
    recipe = replace(RECIPES["demo-v9"], draft_train_bytes=0, draft_prose_bytes=0)
    tokenizer = train_tokenizer(corpus.train_text(20_000), vocab_size=400)
    texts = _texts(recipe, tokenizer, corpus)
    assert demo_build._draft_texts(corpus, tokenizer, recipe, texts) is texts
    assert RECIPES["demo-v8"].draft_train_bytes == RECIPES["demo-v8"].draft_prose_bytes == 0  # earlier versions


def test_wider_draft_budgets_extend_both_streams_past_the_targets_text():
    corpus = stdlib_corpus()
    recipe = replace(
        RECIPES["demo-v9"], train_bytes=3_000, prose_bytes=4_000, draft_train_bytes=9_000, draft_prose_bytes=12_000
    )
    tokenizer = train_tokenizer(corpus.train_text(20_000), vocab_size=400)
    texts = _texts(recipe, tokenizer, corpus)
    wide = demo_build._draft_texts(corpus, tokenizer, recipe, texts)
    assert wide.ids.numel() > 2 * texts.ids.numel() and wide.prose_ids.numel() > 2 * texts.prose_ids.numel()
    # the target's code is where the drafts' starts (a prefix of the same stream, cut at a byte budget)
    assert wide.ids[: texts.ids.numel() - 2].equal(texts.ids[:-2])
