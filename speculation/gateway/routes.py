"""The gateway's routing table: model name -> endpoint + policy, cached per process.

Built from the database in one query and reused while the Redis routing version is unchanged (one GET per
request, about 0.1 ms) and for at most MAX_AGE_S; when Redis is unreachable the table lives NO_REDIS_TTL_S,
so a mode switch still reaches the next request soon after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from fleet.managed.models import ManagedServer
from fleet.models import Endpoint
from speculation.models import Mode, SpeculationPolicy
from speculation.services.version import ROUTING_VERSION_KEY

logger = logging.getLogger(__name__)

MAX_AGE_S = 5.0
NO_REDIS_TTL_S = 0.25
MISS_REBUILD_S = 0.5
REDIS_RETRY_S = 1.0


@dataclass(frozen=True)
class Route:
    endpoint_id: int
    name: str
    base_url: str
    kind: str
    node_class: str
    served_model: str
    api_key: str
    status: str
    capabilities: dict[str, Any]
    mode: str = Mode.OFF
    mechanism: str = ""
    draft_id: int | None = None
    draft_path: str = ""
    k: int = 5
    dynamic_k: bool = False
    shadow_sample_rate: float = 0.0
    path: str = ""
    target_path: str = ""
    upstream_headers: dict[str, str] = field(default_factory=dict)
    # Managed endpoints: tok/s without speculation per concurrency bucket (fleet.managed.baseline).
    native_baseline: dict[str, float] = field(default_factory=dict)


def _build_table() -> dict[str, Route]:
    from speculation.services.policies import resolve_path

    policies = {p.endpoint_id: p for p in SpeculationPolicy.objects.select_related("draft").all()}
    baselines = dict(ManagedServer.objects.values_list("endpoint_id", "baseline"))
    endpoints = list(Endpoint.objects.all())
    names = {endpoint.name for endpoint in endpoints}
    served_by: dict[str, int] = {}
    for endpoint in endpoints:
        if endpoint.served_model:
            served_by[endpoint.served_model] = served_by.get(endpoint.served_model, 0) + 1
    table: dict[str, Route] = {}
    for endpoint in endpoints:
        policy = policies.get(endpoint.pk)
        try:
            api_key = endpoint.api_key
        except ValueError:
            logger.error("endpoint %s: API key cannot be decrypted; sending no key", endpoint.name)
            api_key = ""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        extra: dict[str, Any] = {}
        if policy is not None:
            extra = {
                "mode": policy.mode,
                "mechanism": policy.mechanism,
                "draft_id": policy.draft_id,
                "draft_path": policy.draft.path if policy.draft else "",
                "k": policy.k,
                "dynamic_k": policy.dynamic_k,
                "shadow_sample_rate": policy.shadow_sample_rate,
                "path": resolve_path(policy=policy, endpoint=endpoint),
                "target_path": policy.target_path,
            }
        route = Route(
            endpoint_id=endpoint.pk,
            name=endpoint.name,
            base_url=endpoint.base_url.rstrip("/"),
            kind=endpoint.kind,
            node_class=endpoint.node_class,
            served_model=endpoint.served_model,
            api_key=api_key,
            status=endpoint.status,
            capabilities=dict(endpoint.capabilities or {}),
            upstream_headers=headers,
            native_baseline=dict((baselines.get(endpoint.pk) or {}).get("buckets") or {}),
            **extra,
        )
        table[endpoint.name] = route
        # A served model id routes only when exactly one endpoint serves it and no endpoint is named so: a model
        # name never resolves to two endpoints (the probe records the conflict on the endpoint).
        model = endpoint.served_model
        if model and model != endpoint.name and served_by[model] == 1 and model not in names:
            table[model] = route
    return table


class RouteCache:
    def __init__(self) -> None:
        self._table: dict[str, Route] | None = None
        self._version: bytes | None = None
        self._built_at = 0.0
        self._redis: aioredis.Redis | None = None
        self._redis_down_until = 0.0
        self._lock = asyncio.Lock()

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            self._redis = aioredis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.2, socket_timeout=0.2)
        return self._redis

    async def _current_version(self) -> bytes | None:
        if time.monotonic() < self._redis_down_until:
            return None  # Redis failed a moment ago: do not pay a connect timeout on every request
        try:
            value = await self._client().get(ROUTING_VERSION_KEY)
            return value or b"0"
        except (aioredis.RedisError, OSError):
            self._redis_down_until = time.monotonic() + REDIS_RETRY_S
            return None

    async def table(self) -> dict[str, Route]:
        now = time.monotonic()
        version = await self._current_version()
        fresh = self._table is not None and now - self._built_at < MAX_AGE_S
        if fresh and version is not None and version == self._version:
            return self._table  # type: ignore[return-value]
        if fresh and version is None and now - self._built_at < NO_REDIS_TTL_S:
            return self._table  # type: ignore[return-value]
        async with self._lock:
            if self._table is not None and self._built_at > now:
                return self._table  # another request rebuilt it while this one waited
            from asgiref.sync import sync_to_async

            self._table = await sync_to_async(_build_table, thread_sensitive=True)()
            self._version = version
            self._built_at = time.monotonic()
            return self._table

    async def lookup(self, model: str) -> Route | None:
        route = (await self.table()).get(model)
        if route is None and time.monotonic() - self._built_at > MISS_REBUILD_S:
            # An unknown name may be an endpoint registered a moment ago (its version bump not seen yet).
            self._version = None
            route = (await self.table()).get(model)
        return route


_caches: dict[int, RouteCache] = {}


def route_cache() -> RouteCache:
    """One cache per event loop (an asyncio Redis client belongs to the loop that made it)."""
    loop_id = id(asyncio.get_running_loop())
    cache = _caches.get(loop_id)
    if cache is None:
        cache = _caches[loop_id] = RouteCache()
    return cache
