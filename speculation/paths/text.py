"""Token ids -> text the way vLLM streams it: special tokens skipped, an incomplete UTF-8 tail held back."""

from __future__ import annotations

import json
from pathlib import Path

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def add(self, ids: list[int]) -> str:
        """The new text these tokens complete (held back while it ends in an incomplete character)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip(REPLACEMENT)
        if not text.startswith(self.emitted):
            return ""  # a later token changed earlier text; wait for it to settle
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta


def eos_token_ids(directory: str | Path, tokenizer) -> frozenset[int]:
    """End-of-sequence ids: the tokenizer's, plus generation_config.json's (int or list), as vLLM uses them."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = Path(directory) / "generation_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)
