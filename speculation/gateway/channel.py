"""The gateway's end of the prod token channel (asyncio Redis, one pool per event loop)."""

from __future__ import annotations

import asyncio
import json

import redis.asyncio as aioredis
from django.conf import settings

from speculation.jobs.channel import Message, from_wire, key

_pools: dict[int, aioredis.Redis] = {}


def client() -> aioredis.Redis:
    loop_id = id(asyncio.get_running_loop())
    found = _pools.get(loop_id)
    if found is None:
        found = _pools[loop_id] = aioredis.Redis.from_url(
            settings.REDIS_URL, socket_connect_timeout=0.5, socket_timeout=None, health_check_interval=0
        )
    return found


class ChannelError(RuntimeError):
    """Redis could not be reached or answered badly."""


class GatewayChannel:
    def __init__(self, request_id: str) -> None:
        self.key = key(request_id)

    async def check(self) -> None:
        try:
            await asyncio.wait_for(client().ping(), timeout=1.0)
        except (TimeoutError, aioredis.RedisError, OSError) as exc:
            raise ChannelError(f"redis unavailable: {type(exc).__name__}: {exc}") from exc

    async def receive(self, timeout_s: float) -> Message | None:
        """The next message, or None when none came within timeout_s; ChannelError when it cannot be read."""
        try:
            got = await asyncio.wait_for(client().blpop([self.key], timeout=timeout_s), timeout=timeout_s + 2.0)
        except TimeoutError:
            return None
        except (aioredis.RedisError, OSError) as exc:
            raise ChannelError(f"redis failed while streaming: {type(exc).__name__}: {exc}") from exc
        if got is None:
            return None
        try:
            return from_wire(json.loads(got[1]))
        except ValueError as exc:  # not JSON, or not a message of this code's contract
            raise ChannelError(f"unreadable worker message: {exc}") from exc

    async def discard(self) -> None:
        try:
            await client().delete(self.key)
        except (aioredis.RedisError, OSError):
            pass
