"""The workload key of a gateway request: who says what kind of traffic it is.

Precedence: the `X-ACE-Workload` header (the operator's or client's explicit label), then `metadata.workload`
in the body, then the OpenAI `user` field, then the automatic category of the prompt
(speculation.workloads.classifier). `metadata.workload` comes before `user` because it names a workload, while
`user` names an end user: a key per user splits the evidence thinly (but it is the only label many OpenAI
clients can set). A given key must be at most MAX_LEN characters from KEY_CHARS; anything else is refused
with a 400 naming the field, and the value itself is never echoed or stored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from speculation.workloads.classifier import classify

HEADER = "X-ACE-Workload"
MAX_LEN = 64
KEY_CHARS = "letters, digits, space and . _ : @ / + = -"
_KEY = re.compile(r"[A-Za-z0-9._:@/+=-](?:[A-Za-z0-9 ._:@/+=-]*[A-Za-z0-9._:@/+=-])?")
UNKNOWN = "other"  # the automatic category of a prompt with no text (token ids only)

HEADER_SOURCE, METADATA_SOURCE, USER_SOURCE, AUTO_SOURCE = "header", "metadata.workload", "user", "auto"


@dataclass(frozen=True)
class Workload:
    key: str
    source: str  # header | metadata.workload | user | auto


class BadWorkload(ValueError):
    """A given workload key that is not acceptable; `param` names where it came from."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def checked_key(value: Any, *, param: str) -> str:
    """The key, or BadWorkload saying what is wrong with it (never quoting it: it may be 10 kB of anything)."""
    if not isinstance(value, str):
        raise BadWorkload(param, f"Invalid {param}: expected a string of at most {MAX_LEN} characters.")
    if len(value) > MAX_LEN:
        raise BadWorkload(param, f"Invalid {param}: at most {MAX_LEN} characters (got {len(value)}).")
    if not _KEY.fullmatch(value):
        bad = next((ch for ch in value if not re.fullmatch(r"[A-Za-z0-9 ._:@/+=-]", ch)), None)
        what = f"character U+{ord(bad):04X}" if bad is not None else "leading or trailing space, or nothing"
        raise BadWorkload(param, f"Invalid {param}: only {KEY_CHARS} are allowed (found {what}).")
    return value


def prompt_text(body: dict[str, Any], *, kind: str) -> str:
    """The text the classifier reads: a completion's prompt, or a chat's last user message."""
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else ""
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return content if isinstance(content, str) else ""
    return ""


def resolve(*, header: str | None, body: dict[str, Any], kind: str) -> Workload:
    """The request's workload; BadWorkload when a given key is not acceptable."""
    if header is not None:
        return Workload(checked_key(header, param=f"{HEADER} header"), HEADER_SOURCE)
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and metadata.get("workload") is not None:
        return Workload(checked_key(metadata["workload"], param="metadata.workload"), METADATA_SOURCE)
    if body.get("user") is not None and body.get("user") != "":
        return Workload(checked_key(body["user"], param="user"), USER_SOURCE)
    text = prompt_text(body, kind=kind)
    return Workload(classify(text) if text.strip() else UNKNOWN, AUTO_SOURCE)
