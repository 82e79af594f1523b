"""When the gateway's per-process caches (the routing table, token principals) must be rebuilt.

Each cache entry carries the stamp of the gateway version it was built at: the Redis counter that every process
bumps after writing an endpoint, policy, draft, token, scope, user or group (speculation.services.version), and
this process's own generation, bumped at once by the same signals (so a change made in this process applies
here on the next request even before Redis is told, or when Redis is down). An entry is fresh while the stamp
is unchanged and it is younger than its max age; while Redis cannot be read, for NO_REDIS_TTL_S only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from django.conf import settings

from speculation.services.version import ROUTING_VERSION_KEY, local_generation

NO_REDIS_TTL_S = 0.25
REDIS_RETRY_S = 1.0


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
    """Reads the Redis counter (one GET, about 0.1 ms); one per event loop (its client belongs to the loop)."""

    def __init__(self) -> None:
        self._redis: aioredis.Redis | None = None
        self._down_until = 0.0

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.2, socket_timeout=0.2)
        return self._redis

    async def stamp(self) -> Stamp:
        local = local_generation()
        now = time.monotonic()
        if now < self._down_until:
            return Stamp(None, local, now)  # Redis failed a moment ago: no connect timeout on every request
        try:
            value = await self._client().get(ROUTING_VERSION_KEY)
        except (aioredis.RedisError, OSError):
            self._down_until = time.monotonic() + REDIS_RETRY_S
            return Stamp(None, local, now)
        return Stamp(value or b"0", local, now)
