"""Foreign prefixes (``TrainPlan.foreign_share``, demo-v10 on): the target learns to answer any prompt with its own
text, and is never trained to predict the prompt itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from speculation.offline.demo import build as demo_build
from speculation.offline.demo.corpus import stdlib_corpus
from speculation.offline.demo.recipes import RECIPES
from speculation.offline.demo.tokenizer import train_tokenizer
from speculation.offline.demo.train import TrainPlan, _foreign_batch, train_target

BOS = 0


def _streams():
    """Own code 100..199, own prose (BOS + runs in 300..399), foreign English 500..599, foreign code 700..799."""
    code = torch.arange(100, 200).repeat(10)
    prose = torch.cat([torch.cat([torch.tensor([BOS]), torch.arange(300, 340) + i % 60]) for i in range(80)])
    return code, prose, (torch.arange(500, 600).repeat(5), torch.arange(700, 800).repeat(5))


def _plan(**fields) -> TrainPlan:
    return replace(TrainPlan(seq_len=96, target_batch=64, prose_share=0.7, foreign_share=0.5), **fields)


def test_a_foreign_prefix_is_left_out_of_the_loss_and_the_targets_own_text_follows():
    code, prose, foreign = _streams()
    batch, labels = _foreign_batch(code, prose, foreign, _plan(), torch.Generator().manual_seed(1))
    assert batch.shape == labels.shape == (64, 96)
    prefixed = 0
    for row, label in zip(batch.tolist(), labels.tolist(), strict=True):
        masked = [t for t, lab in zip(row, label, strict=True) if lab == -100]
        kept = [t for t, lab in zip(row, label, strict=True) if lab != -100]
        assert kept == row[len(masked) :]  # the loss starts right after the prefix
        assert all(t < 500 for t in kept)  # never a foreign token in the loss
        if masked:
            prefixed += 1
            assert masked[0] == BOS and 8 <= len(masked) - 1 < 64
            assert all(t >= 500 for t in masked[1:])  # the prefix is foreign text only
            assert kept[0] != BOS  # own prose starts after its paragraph's BOS, as an answer does
    # 64 rows at share 0.5: 32 expected, sd 4; outside 16..48 is a 4-sd event (a wrong share is far outside)
    assert 16 <= prefixed <= 48
    again, _ = _foreign_batch(code, prose, foreign, _plan(), torch.Generator().manual_seed(1))
    assert again.equal(batch)  # seeded


def test_without_foreign_prefixes_every_label_is_its_token():
    code, prose, foreign = _streams()
    batch, labels = _foreign_batch(code, prose, foreign, _plan(foreign_share=0.0), torch.Generator().manual_seed(2))
    assert labels.equal(batch)


def test_training_with_foreign_prefixes_needs_their_text():
    code, prose, _ = _streams()
    with pytest.raises(ValueError, match="foreign prefixes"):
        train_target(torch.nn.Linear(1, 1), code, _plan(), seed=0, prose_ids=prose, foreign=None)


def test_only_recipes_that_ask_for_them_draw_foreign_text():
    corpus = stdlib_corpus()
    tokenizer = train_tokenizer(corpus.train_text(20_000), vocab_size=400)
    assert demo_build._foreign_texts(corpus, tokenizer, RECIPES["demo-v9"]) is None
    recipe = replace(RECIPES["demo-v10"], foreign_prose_bytes=6_000, foreign_code_bytes=8_000, train_bytes=3_000)
    english, code = demo_build._foreign_texts(corpus, tokenizer, recipe)
    assert english[0] == tokenizer.token_to_id(demo_build.BOS)  # paragraphs, each after BOS
    own = demo_build._encode(tokenizer, corpus.train_text(3_000))
    assert code.numel() > own.numel()
    # the foreign code is the stream past the target's own text, not the same bytes
    assert not code[:64].equal(own[:64])
