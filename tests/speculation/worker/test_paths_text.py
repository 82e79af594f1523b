"""The incremental detokenizer the stop matcher calls once per committed token: however the tokens arrive, the
text it hands out adds up to the whole output's decoding, and it never hands out half a character."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from speculation.worker.paths.text import REPLACEMENT, IncrementalText

TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Héllo wörld — ünïcödé ✓ 日本語テキスト 🙂 end.",
    "  leading  spaces\tand\ttabs\n\n",
]


@pytest.fixture(scope="module")
def tokenizer(demo_pair):
    return AutoTokenizer.from_pretrained(demo_pair.target_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_any_split_of_the_tokens_gives_the_whole_decoding(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for _ in range(30):
        # given the tokens in random batches of 1-4, when each batch is added, then the pieces add up
        incremental, pieces, i = IncrementalText(tokenizer), [], 0
        while i < len(ids):
            n = rng.randint(1, 4)
            pieces.append(incremental.add(ids[i : i + n]))
            i += n
        assert "".join(pieces) == whole
        assert not any(piece.endswith(REPLACEMENT) for piece in pieces)
