"""When the gateway's per-process caches (the routing table, token principals) must be rebuilt.

Each cache entry carries the stamp of the gateway version it was built at: the Redis counter that every process
bumps after writing an endpoint, policy, draft, token, scope, user or group (speculation.services.version), and
this process's own generation, bumped at once by the same signals (so a change made in this process applies
here on the next request even before Redis is told, or when Redis is down). An entry is fresh while the stamp
is unchanged and it is younger than its max age; while Redis cannot be read, for NO_REDIS_TTL_S only.

Reading the counter is one Redis GET per request, unless the reader follows the bumps (the lean /v1 app does):
a subscriber task then receives each new value as it is published, and a request reads no Redis at all; the
counter is still read at most every RECHECK_S (a push lost with a broken connection, a Redis restart).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from django.conf import settings

from speculation.services.version import ROUTING_VERSION_KEY, VERSION_CHANNEL, local_generation

logger = logging.getLogger(__name__)

NO_REDIS_TTL_S = 0.25
REDIS_RETRY_S = 1.0
RECHECK_S = 1.0


@dataclass(frozen=True)
class Stamp:
    redis: bytes | None  # None: Redis could not be read
    local: int
    read_at: float  # time.monotonic()

    def keeps(self, built: Stamp, *, max_age_s: float) -> bool:
        """Whether an entry built at `built` is still fresh at this stamp."""
        age = self.read_at - built.read_at
        if self.local != built.local:
            return False
        if self.redis is None:
            return age < NO_REDIS_TTL_S
        return self.redis == built.redis and age < max_age_s


class VersionReader:
    """Reads the Redis counter; one per event loop (its clients belong to the loop)."""

    def __init__(self) -> None:
        self._redis: aioredis.Redis | None = None
        self._down_until = 0.0
        self._known = b"0"  # the value last read or pushed
        self._read_at = float("-inf")
        self._subscribed = False
        self._listener: asyncio.Task | None = None

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.2, socket_timeout=0.2)
        return self._redis

    def follow_bumps(self) -> None:
        """Subscribe to the version channel (once; the task lives as long as the event loop)."""
        if self._listener is None:
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def stamp(self) -> Stamp:
        local = local_generation()
        now = time.monotonic()
        if self._subscribed and now - self._read_at < RECHECK_S:
            return Stamp(self._known, local, now)
        if now < self._down_until:
            return Stamp(None, local, now)  # Redis failed a moment ago: no connect timeout on every request
        try:
            value = await self._client().get(ROUTING_VERSION_KEY)
        except (aioredis.RedisError, OSError):
            self._down_until = time.monotonic() + REDIS_RETRY_S
            return Stamp(None, local, now)
        self._known, self._read_at = value or b"0", now
        return Stamp(self._known, local, now)

    async def _listen(self) -> None:
        while True:
            # No socket timeout: the subscription waits for as long as nothing changes.
            client = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.2, socket_keepalive=True)
            try:
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(VERSION_CHANNEL)
                    async for message in pubsub.listen():
                        if message["type"] == "subscribe":
                            self._read_at = float("-inf")  # read once: a bump may have come before the subscription
                            self._subscribed = True
                        elif message["type"] == "message":
                            self._known = message["data"]
            except (aioredis.RedisError, OSError) as exc:
                logger.debug("gateway version subscription lost (%s); reading the counter per request", exc)
            finally:
                self._subscribed = False
                await client.aclose()
            await asyncio.sleep(REDIS_RETRY_S)
