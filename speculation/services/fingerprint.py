"""Tokenizer fingerprint of a local model directory, computed exactly the way the endpoint probe does:
sha256 over the token ids of fleet's canary text, special tokens added (fleet.probing documents it).

Read from tokenizer.json with the `tokenizers` library (no torch: the web process calls it);
speculation.services.model_files holds the implementation.
"""

from __future__ import annotations

from pathlib import Path

from speculation.services.model_files import tokenizer_fingerprint


def tokenizer_fingerprint_of_dir(directory: Path) -> str:
    return tokenizer_fingerprint(Path(directory), field="path")
