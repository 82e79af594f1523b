"""Token ids -> text the way vLLM streams it: special tokens skipped, an incomplete UTF-8 tail held back."""

from __future__ import annotations

import json
from pathlib import Path

REPLACEMENT = "\ufffd"


class IncrementalText:
    """Decodes only a short window of tokens per call (vLLM's prefix/read offsets), not the whole output: the
    stop matcher calls it once per committed token, so decoding everything each time would be quadratic."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read]: context already turned into text, decoded again for its spacing
        self._read = 0

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        """The new text these tokens complete (held back while it ends in an incomplete character)."""
        self.ids.extend(ids)
        before = self._decode(self._prefix, self._read)
        text = self._decode(self._prefix)
        if len(text) <= len(before) or text.endswith(REPLACEMENT) or not text.startswith(before):
            return ""  # nothing new yet, an incomplete character, or a later token changed earlier text
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before) :]


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
