"""Training text every machine has: the Python standard library's own sources.

The file list is fixed (sorted relative paths, tests and vendored packages left out) and split into a
training part and a held-out part (every ``HELD_OUT_EVERY``-th file), so evaluation never sees training text.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_EVERY = 10
EXCLUDED_PARTS = frozenset({"test", "tests", "site-packages", "idle_test", "lib2to3", "__pycache__", "ensurepip"})
FILE_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Corpus:
    train_files: tuple[Path, ...]
    held_out_files: tuple[Path, ...]

    def train_text(self, byte_budget: int) -> str:
        return _read_budget(self.train_files, byte_budget)

    def held_out_text(self, byte_budget: int) -> str:
        return _read_budget(self.held_out_files, byte_budget)

    def prose_text(self, byte_budget: int) -> str:
        """The English in the training files: comment lines and docstring lines, stripped of code."""
        return _prose(_read_budget(self.train_files, 4 * byte_budget))[:byte_budget]


def stdlib_corpus(root: Path | None = None) -> Corpus:
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not EXCLUDED_PARTS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if len(files) < 2 * HELD_OUT_EVERY:
        raise RuntimeError(f"too few Python sources under {root} to build the demo corpus")
    held = tuple(p for i, p in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
    train = tuple(p for i, p in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1)
    return Corpus(train_files=train, held_out_files=held)


def _prose(text: str) -> str:
    lines: list[str] = []
    in_docstring = False
    for raw in text.splitlines():
        line = raw.strip()
        quotes = line.count('"""') + line.count("'''")
        if line.startswith("#"):
            lines.append(line.lstrip("#").strip())
        elif in_docstring or line.startswith(('"""', "'''")):
            lines.append(line.strip("\"'"))
        if quotes % 2 == 1:
            in_docstring = not in_docstring
    return " ".join(part for part in lines if part and not part.startswith(("!", "-*-")))


def _read_budget(files: tuple[Path, ...], byte_budget: int) -> str:
    parts: list[str] = []
    used = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        used += len(text.encode("utf-8"))
        if used >= byte_budget:
            break
    return FILE_SEPARATOR.join(parts)[:byte_budget]
