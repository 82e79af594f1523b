"""Server-sent events as OpenAI and vLLM send them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
import re
from typing import Any

from ace import json_body

DONE = b"data: [DONE]\n\n"


def dumps(payload: dict[str, Any]) -> str:
    """Compact JSON the way vLLM (pydantic / starlette) writes it, so rewritten bodies keep their bytes."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload).encode() + b"\n\n"


class EventSplitter:
    """Feed raw stream bytes, get back complete events (the raw bytes of each, separator included)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        events = []
        while True:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                return events
            events.append(self._buffer[: end + 2])
            self._buffer = self._buffer[end + 2 :]


def payload_of(raw_event: bytes) -> dict[str, Any] | None:
    """The JSON object an event carries; None for [DONE], comments and anything not JSON."""
    for line in raw_event.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            try:
                value = json_body.loads(data)  # nested too deep: TooDeep, a ValueError
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EVENT = b"data: {"


class TokenCount:
    """The output tokens of an answer relayed as the server sent it, found with one regular expression per body or
    chunk and no JSON parsed (the off path stays a relay; a plain prod request pays no more): the usage the server
    reports, else (a stream without usage) the number of events, less a chat stream's first, which carries the role
    only."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.usage: int | None = None
        self.events = 0

    def body(self, body: bytes) -> None:
        found = _USAGE.search(body)
        if found:
            self.usage = int(found.group(1))

    def chunk(self, chunk: bytes) -> None:
        self.events += chunk.count(_EVENT)
        if b'"completion_tokens"' in chunk:
            found = _USAGE.search(chunk)
            if found:
                self.usage = int(found.group(1))

    def tokens(self) -> int:
        if self.usage is not None:
            return self.usage
        role_event = 1 if self.kind == "chat" else 0
        return max(0, self.events - role_event)
