"""The automatic workload category of a prompt: a multinomial naive-Bayes model over cheap text features.

Runs in the web process on every shadow / prod request without a workload key, so it is pure Python with no
third-party import: lower-cased word tokens from the head and tail of the prompt (a long context's question
sits at its end), the prompt's length bucket, and symbol tokens that separate code from prose. The model
(`classifier.json` beside this file) is trained offline on Spec-Bench's labelled prompts by
`python -m speculation.offline.workload_classifier`, which also reports its held-out accuracy
(docs/BENCHMARKS.md). Raw source code (a completion prompt such as "def fibonacci(n):") is recognised by a
line rule first: Spec-Bench's coding prompts are English requests for code, not code.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

MODEL_PATH = Path(__file__).with_name("classifier.json")
HEAD_CHARS = 1500  # the words read from the start of the prompt ...
TAIL_CHARS = 500  # ... and from its end: bounded cost however long the prompt is
CODE = "code"
LENGTH_WEIGHT = 3  # the length bucket counts as this many tokens (it separates qa from rag and summaries)

# Spec-Bench category -> workload category (what the auto-pairing table groups by).
CATEGORY_OF = {
    "coding": CODE,
    "math": "math",
    "math_reasoning": "math",
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "rag": "rag",
    "writing": "writing",
    "roleplay": "writing",
    "reasoning": "chat",
    "stem": "chat",
    "humanities": "chat",
    "extraction": "chat",
}

_WORD = re.compile(r"[a-z]+|\d+|[{}()\[\];=<>#$%*/\\:+]")
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |#include|return\b|public |private |function |const |let |var |"
    r"fn |func |package |@\w)|[;{}]\s*$|:\s*$"
)


def features(text: str) -> list[str]:
    """The tokens the model counts: words and symbols of the head and tail, one length-bucket token."""
    lowered = text.lower()
    part = lowered if len(lowered) <= HEAD_CHARS + TAIL_CHARS else lowered[:HEAD_CHARS] + " " + lowered[-TAIL_CHARS:]
    tokens = sorted(set(_WORD.findall(part)))  # presence, not counts: a long text's repeats do not outvote
    tokens += [f"__len{min(14, int(math.log2(len(text) + 1)))}"] * LENGTH_WEIGHT
    if any(ord(ch) > 127 for ch in part):
        tokens.append("__non_ascii")
    return tokens


_CODE_ASK = re.compile(
    r"\b(write|implement|develop|create|fix|debug|refactor)\b.{0,80}\b(python|c\+\+|java|javascript|typescript|sql|"
    r"html|css|rust|golang|bash|regex|regular expression|function|program|code|script)\b",
    re.IGNORECASE | re.DOTALL,
)


_SOURCE_START = re.compile(r'\s*("""|\'\'\'|#!|# -\*-|#include\b|(from \S+ )?import \w|package \w|// |/\*)')


def looks_like_code(text: str) -> bool:
    """Source code rather than a request in prose: most of its first lines look like code."""
    lines = [line for line in text[:HEAD_CHARS].splitlines() if line.strip()][:20]
    if not lines:
        return False
    if "```" in text[:HEAD_CHARS] or (len(text) < HEAD_CHARS and _CODE_ASK.search(text)):
        return True  # a fenced snippet, or a short request for code ("Write a C++ program to ...")
    if _SOURCE_START.match(text):
        return True  # a source file's beginning: a module docstring, a shebang, a comment header, an import
    hits = sum(1 for line in lines if _CODE_LINE.search(line))
    return hits * 2 >= len(lines) and (hits >= 2 or len(lines) == 1)


@dataclass(frozen=True)
class NaiveBayes:
    """log P(class) + sum over tokens of log P(token | class); unknown tokens are ignored."""

    priors: dict[str, float]
    log_probs: dict[str, dict[str, float]]  # token -> class -> log P(token | class)
    unseen: dict[str, float]  # class -> log P(token | class) of a token seen in training but not in this class

    def scores(self, tokens: list[str]) -> dict[str, float]:
        scores = dict(self.priors)
        for token in tokens:
            row = self.log_probs.get(token)
            if row is None:
                continue
            for label in scores:
                scores[label] += row.get(label, self.unseen[label])
        return scores

    def predict(self, tokens: list[str]) -> str:
        scores = self.scores(tokens)
        return max(sorted(scores), key=scores.__getitem__)

    def to_json(self) -> dict:
        return {"priors": self.priors, "log_probs": self.log_probs, "unseen": self.unseen}

    @classmethod
    def from_json(cls, data: dict) -> NaiveBayes:
        return cls(priors=data["priors"], log_probs=data["log_probs"], unseen=data["unseen"])


@lru_cache(maxsize=1)
def model() -> NaiveBayes:
    return NaiveBayes.from_json(json.loads(MODEL_PATH.read_text()))


def classify(text: str, *, nb: NaiveBayes | None = None) -> str:
    """The workload category of a prompt's text."""
    if looks_like_code(text):
        return CODE
    return (nb or model()).predict(features(text))
