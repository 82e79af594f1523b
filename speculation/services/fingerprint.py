"""Tokenizer fingerprint of a local model directory, computed exactly the way the endpoint probe does:
sha256 over the token ids of fleet's canary text, special tokens added (fleet.probing documents it)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=32)
def tokenizer_fingerprint_of_dir(directory: Path) -> str:
    from transformers import AutoTokenizer

    from fleet.probing import CANARY_TEXT, fingerprint_token_ids

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    ids = tokenizer(CANARY_TEXT, add_special_tokens=True)["input_ids"]
    return fingerprint_token_ids(list(ids))
