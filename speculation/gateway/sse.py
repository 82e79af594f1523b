"""Server-sent events as OpenAI and vLLM send them: `data: <json>\\n\\n` ... `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
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
