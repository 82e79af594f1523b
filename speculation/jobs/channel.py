"""The Redis channel that carries a prod request's tokens from the GPU worker back to the gateway.

One Redis list per request id. The worker RPUSHes JSON messages as tokens are committed; the gateway BLPOPs
them. Each message is one dataclass below, sent as {"type": ..., **its fields}: Started, Ready, Tokens, then Done,
or Error / Cancelled. Lists expire after EXPIRE_S so an abandoned request leaves nothing behind.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import redis

EXPIRE_S = 300


def key(request_id: str) -> str:
    return f"ace:prod:{request_id}"


@dataclass(frozen=True)
class Started:
    """The worker took the request (before loading anything: the gateway's start timeout is short)."""

    type: ClassVar[str] = "started"


@dataclass(frozen=True)
class Ready:
    """Loaded and calibrated: from here the gateway's per-step timeout applies."""

    type: ClassVar[str] = "ready"


@dataclass(frozen=True)
class Tokens:
    """Tokens committed by one verification step, and the text they complete."""

    type: ClassVar[str] = "tokens"
    ids: list[int]
    text: str


@dataclass(frozen=True)
class Done:
    """The last message of a served request: why it ended, the held-back text, and the stage record's fields."""

    type: ClassVar[str] = "done"
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None  # the stop string or token id that ended it (vLLM's stop_reason)
    text: str
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Error:
    """The speculative path failed: the gateway falls back (continues plain), with the reason."""

    type: ClassVar[str] = "error"
    reason: str


@dataclass(frozen=True)
class Cancelled:
    """The worker stopped after ``tokens`` tokens because the gateway asked it to (speculation.jobs.admission)."""

    type: ClassVar[str] = "cancelled"
    tokens: int


Message = Started | Ready | Tokens | Done | Error | Cancelled
MESSAGES: dict[str, type[Message]] = {cls.type: cls for cls in (Started, Ready, Tokens, Done, Error, Cancelled)}


def to_wire(message: Message) -> dict[str, Any]:
    return {"type": message.type, **asdict(message)}


def from_wire(data: dict[str, Any]) -> Message:
    """The message a channel entry carries; ValueError naming an unknown type or field, or a missing field."""
    cls = MESSAGES.get(data.get("type"))
    if cls is None:
        raise ValueError(f"unknown channel message type {data.get('type')!r}")
    fields = {name: value for name, value in data.items() if name != "type"}
    try:
        return cls(**fields)
    except TypeError as exc:
        raise ValueError(f"channel message {cls.type!r}: {exc}") from None


class WorkerChannel:
    """The worker's end (synchronous redis-py)."""

    def __init__(self, client: redis.Redis, request_id: str) -> None:
        self.client = client
        self.key = key(request_id)

    def send(self, message: Message, *, slot: Any = None, release: Any = None) -> None:
        """Push one message; with the job's slot (speculation.jobs.admission.JobSlot) the same round trip refreshes
        it and raises Cancelled when the gateway asked the job to stop. ``release`` (a JobSlot) frees the slot
        before the message goes out: the job's last message, so the client's next request finds it free."""
        pipe = self.client.pipeline(transaction=False)
        if release is not None:
            release.release(pipe)
        pipe.rpush(self.key, json.dumps(to_wire(message)))
        pipe.expire(self.key, EXPIRE_S)
        if slot is not None:
            slot.check(pipe)
        results = pipe.execute()
        if slot is not None:
            slot.raise_if_cancelled(results[-1])


def announce_started(request_id: str) -> None:
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=10)
    try:
        WorkerChannel(client, request_id).send(Started())
    finally:
        client.close()
