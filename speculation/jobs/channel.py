"""The Redis channel that carries a prod request's tokens from the GPU worker back to the gateway.

One Redis list per request id. The worker RPUSHes JSON messages as tokens are committed; the gateway BLPOPs
them. Messages:
    {"type": "started"}                                   the worker took the request
    {"type": "tokens", "ids": [...], "text": "..."}       tokens committed by one verification step
    {"type": "done", "finish_reason": "stop"|"length", "stats": {...}}
    {"type": "error", "reason": "..."}                    the speculative path failed (the gateway falls back)
    {"type": "cancelled", "tokens": n}                    the worker stopped after n tokens (speculation.jobs.admission)
Lists expire after EXPIRE_S so an abandoned request leaves nothing behind.
"""

from __future__ import annotations

import json
from typing import Any

import redis

EXPIRE_S = 300


def key(request_id: str) -> str:
    return f"ace:prod:{request_id}"


class WorkerChannel:
    """The worker's end (synchronous redis-py)."""

    def __init__(self, client: redis.Redis, request_id: str) -> None:
        self.client = client
        self.key = key(request_id)

    def send(self, message: dict[str, Any], *, slot: Any = None, release: Any = None) -> None:
        """Push one message; with the job's slot (speculation.jobs.admission.JobSlot) the same round trip refreshes
        it and raises Cancelled when the gateway asked the job to stop. ``release`` (a JobSlot) frees the slot
        before the message goes out: the job's last message, so the client's next request finds it free."""
        pipe = self.client.pipeline(transaction=False)
        if release is not None:
            release.release(pipe)
        pipe.rpush(self.key, json.dumps(message))
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
        WorkerChannel(client, request_id).send({"type": "started"})
    finally:
        client.close()
