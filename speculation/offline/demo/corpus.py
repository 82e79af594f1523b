"""Training text every machine has: the Python standard library's own sources, and English beside them.

The file list is fixed (sorted relative paths, tests and vendored packages left out) and split into a
training part and a held-out part (every ``HELD_OUT_EVERY``-th file), so evaluation never sees training text.
``english_text`` (demo-v4 on) is prose in a fixed order: the training files' docstrings (parsed, not
line-matched), the reference documentation the stdlib ships for ``pydoc`` (``pydoc_data/topics.py``), IDLE's
text files and Debian's ``/usr/share/common-licenses`` where present.
"""

from __future__ import annotations

import ast
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_EVERY = 10
EXCLUDED_PARTS = frozenset({"test", "tests", "site-packages", "idle_test", "lib2to3", "__pycache__", "ensurepip"})
FILE_SEPARATOR = "\n\n"
DEBIAN_LICENSES = Path("/usr/share/common-licenses")


@dataclass(frozen=True)
class Corpus:
    train_files: tuple[Path, ...]
    held_out_files: tuple[Path, ...]
    root: Path | None = None

    def train_text(self, byte_budget: int) -> str:
        return _read_budget(self.train_files, byte_budget)

    def held_out_text(self, byte_budget: int) -> str:
        return _read_budget(self.held_out_files, byte_budget)

    def prose_text(self, byte_budget: int) -> str:
        """The English in the training files: comment lines and docstring lines, stripped of code."""
        return _prose(_read_budget(self.train_files, 4 * byte_budget))[:byte_budget]

    def english_text(self, byte_budget: int, *, held_out: bool = False, sources: tuple[str, ...] = ()) -> str:
        """English prose (see the module docstring); ``held_out``: the held-out files' docstrings only;
        ``sources``: only these of "docstrings", "pydoc topics", "idle", "licences"."""
        if held_out:
            return _read_parts(_docstrings(self.held_out_files), byte_budget)
        documents = [("docstrings", _docstrings(self.train_files))]
        if self.root is not None:
            documents.append(("pydoc topics", _pydoc_topics(self.root / "pydoc_data" / "topics.py")))
            documents.append(("idle", _text_files(sorted((self.root / "idlelib").glob("*.txt")))))
        if DEBIAN_LICENSES.is_dir():
            documents.append(("licences", _text_files(sorted(DEBIAN_LICENSES.iterdir()))))
        if sources:  # a subset, by name
            documents = [(name, parts) for name, parts in documents if name in sources]
        # interleave the sources so any byte budget gets some of each
        share = byte_budget // len(documents)
        return FILE_SEPARATOR.join(_read_parts(parts, share) for _, parts in documents)[:byte_budget]


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
    return Corpus(train_files=train, held_out_files=held, root=root)


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


def unwrap_paragraphs(text: str) -> list[str]:
    """Paragraphs (blank-line separated) with their hard line wraps and indentation joined into one line,
    the way a prompt is written."""
    return [p for p in (" ".join(block.split()) for block in text.split("\n\n")) if p]


def _docstrings(files: tuple[Path, ...]):
    """Module, class and function docstrings, cleaned of their indentation, file by file."""
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 40:
                yield doc


def _pydoc_topics(path: Path):
    """The reference manual's sections as plain text (the file is one dict literal of strings)."""
    if not path.is_file():
        return
    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for key in sorted(node.value.keys, key=lambda k: getattr(k, "value", "")):
                value = node.value.values[node.value.keys.index(key)]
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value


def _text_files(paths: list[Path]):
    for path in paths:
        if path.is_file() and not path.is_symlink():
            yield path.read_text(encoding="utf-8", errors="replace")


def _read_parts(parts, byte_budget: int) -> str:
    chosen: list[str] = []
    used = 0
    for part in parts:
        chosen.append(part)
        used += len(part.encode("utf-8"))
        if used >= byte_budget:
            break
    return FILE_SEPARATOR.join(chosen)[:byte_budget]
