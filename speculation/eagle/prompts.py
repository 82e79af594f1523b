"""Prompt sources for EAGLE head training and evaluation: Spec-Bench questions or a local text file.

Spec-Bench lives outside the repository, in `../shared/datasets/spec_bench_questions.jsonl` relative to the
repository root; `ACE_SPEC_BENCH` overrides the path. A text file is either JSON lines (objects with a
"prompt", "text" or "turns" field) or plain text with one prompt per paragraph (blank-line separated).
(Shadow traffic is not a source: stage records keep counts and rates, never prompt text.)
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_BENCH = "spec_bench"


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


class PromptSourceError(ValueError):
    """The prompt source is missing or holds no prompts."""


def spec_bench_path() -> Path:
    override = os.environ.get("ACE_SPEC_BENCH")
    if override:
        return Path(override)
    return REPO_ROOT.parent / "shared" / "datasets" / "spec_bench_questions.jsonl"


def _from_json_line(obj: dict, default_category: str) -> Prompt | None:
    text = obj.get("prompt") or obj.get("text") or (obj.get("turns") or [None])[0]
    if not isinstance(text, str) or not text.strip():
        return None
    return Prompt(category=str(obj.get("category") or default_category), text=text.strip())


def read_prompts(source: str) -> list[Prompt]:
    """All prompts of a source: "spec_bench" or a path to a .jsonl / text file."""
    path = spec_bench_path() if source in ("", SPEC_BENCH) else Path(source)
    if not path.is_file():
        raise PromptSourceError(f"prompt source {str(path)!r} is not a file (set ACE_SPEC_BENCH or pass --prompts)")
    raw = path.read_text(encoding="utf-8", errors="replace")
    prompts: list[Prompt] = []
    if path.suffix in (".jsonl", ".json"):
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompt = _from_json_line(json.loads(line), default_category="file")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise PromptSourceError(f"{path}:{number} is not a JSON object: {exc}") from exc
            if prompt:
                prompts.append(prompt)
    else:
        prompts = [Prompt("file", block.strip()) for block in raw.split("\n\n") if block.strip()]
    if not prompts:
        raise PromptSourceError(f"prompt source {str(path)!r} holds no prompts")
    return prompts


def split_prompts(prompts: list[Prompt], *, held_out: float, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """A seeded split that keeps every category on both sides (at least one held-out prompt per category)."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    rng = random.Random(seed)
    train: list[Prompt] = []
    test: list[Prompt] = []
    for category in sorted(by_category):
        group = list(by_category[category])
        rng.shuffle(group)
        n_test = max(1, round(len(group) * held_out)) if len(group) > 1 else 0
        test += group[:n_test]
        train += group[n_test:]
    return train, test
