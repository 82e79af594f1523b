"""Prompt sources for EAGLE head training and evaluation: Spec-Bench questions or a local text file.

Sources (comma-separated to mix): `spec_bench` (the vendored `speculation/bench/data/spec_bench_questions.jsonl`;
`ACE_SPEC_BENCH` overrides the path), `stdlib` (the beginnings of the Python standard library's files in the demo
corpus' training split, category "code"), `docstrings` (the starts of 512 paragraphs of those files' docstrings,
evenly spread, category "prose": the demo target answers any prompt with a memorised passage, and its main draft
is distilled on its continuations of such docstring text), or a file: JSON lines (objects with a "prompt", "text" or
"turns" field and an optional "category") or plain text, one prompt per paragraph.
An endpoint's captured traffic is a source of another kind, `captured:<endpoint id>[:<workload>]` (pooled, or one
workload's): token ids of prompts and of the outputs the target served (speculation.services.captures), trained on
as they are (speculation.offline.eagle.captured), never mixed with text sources. Stage records are no source: they
keep counts and rates, never prompts.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

VENDORED_SPEC_BENCH = Path(__file__).resolve().parents[2] / "bench" / "data" / "spec_bench_questions.jsonl"
SPEC_BENCH = "spec_bench"
STDLIB = "stdlib"
STDLIB_PROMPT_CHARS = 400
DOCSTRINGS = "docstrings"
DOCSTRING_PROMPTS = 512
DOCSTRING_PROMPT_CHARS = 160


CAPTURED = "captured"


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str


@dataclass(frozen=True)
class CapturedSequence:
    """One captured request: its prompt and the output the target served, as token ids; category: its workload."""

    category: str
    prompt_ids: list[int]
    output_ids: list[int]
    capture_id: int = 0  # the CapturedRequest it was read from
    greedy: bool = False  # served with temperature 0


def captured_source(part: str) -> tuple[str, str | None] | None:
    """(endpoint, workload or None) of a `captured:<endpoint>[:<workload>]` source; None for any other source."""
    kind, _, rest = part.strip().partition(":")
    if kind != CAPTURED or not rest:
        return None
    endpoint, _, workload = rest.partition(":")  # a workload key may hold ":" itself; an endpoint name never does
    return endpoint, workload or None


class PromptSourceError(ValueError):
    """The prompt source is missing or holds no prompts."""


def spec_bench_path() -> Path:
    override = os.environ.get("ACE_SPEC_BENCH")
    if override:
        return Path(override)
    return VENDORED_SPEC_BENCH


def _from_json_line(obj: dict, default_category: str) -> Prompt | None:
    text = obj.get("prompt") or obj.get("text") or (obj.get("turns") or [None])[0]
    if not isinstance(text, str) or not text.strip():
        return None
    return Prompt(category=str(obj.get("category") or default_category), text=text.strip())


def read_prompts(source: str) -> list[Prompt]:
    """All prompts of one source or of several (comma-separated), in source order."""
    prompts: list[Prompt] = []
    for part in (source or SPEC_BENCH).split(","):
        prompts += _read_source(part.strip())
    return prompts


def _stdlib_prompts() -> list[Prompt]:
    from speculation.offline.demo.corpus import stdlib_corpus

    prompts = []
    for path in stdlib_corpus().train_files:
        text = path.read_text(encoding="utf-8", errors="replace")[:STDLIB_PROMPT_CHARS].strip()
        if text:
            prompts.append(Prompt("code", text))
    return prompts


@functools.cache
def _docstring_prompts() -> tuple[Prompt, ...]:
    from speculation.offline.demo.corpus import FILE_SEPARATOR, stdlib_corpus, unwrap_paragraphs

    text = stdlib_corpus().english_text(2_000_000, sources=("docstrings",))
    paragraphs = [p for p in unwrap_paragraphs(text.replace(FILE_SEPARATOR, "\n\n")) if len(p) >= 80]
    step = max(1, len(paragraphs) // DOCSTRING_PROMPTS)
    return tuple(Prompt("prose", p[:DOCSTRING_PROMPT_CHARS]) for p in paragraphs[::step][:DOCSTRING_PROMPTS])


def _read_source(source: str) -> list[Prompt]:
    if source == STDLIB:
        return _stdlib_prompts()
    if source == DOCSTRINGS:  # parsing the docstrings takes seconds: once per process
        return list(_docstring_prompts())
    path = spec_bench_path() if source == SPEC_BENCH else Path(source)
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


def split_prompts(
    prompts: list[Prompt] | list[CapturedSequence], *, held_out: float, min_held_out: int = 3
) -> tuple[list, list]:
    """Hold out the first prompts of every category (file order), at least min_held_out of each when it has more.

    The benchmark (`python -m speculation.bench`) measures on the first prompts of each Spec-Bench category, so
    a head is never trained on the prompts it is benchmarked on.
    """
    by_category: dict[str, list] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    train: list = []
    test: list = []
    for category in sorted(by_category):
        group = by_category[category]
        n_test = min(len(group) - 1, max(min_held_out, round(len(group) * held_out)))
        test += group[:n_test]
        train += group[n_test:]
    return train, test
