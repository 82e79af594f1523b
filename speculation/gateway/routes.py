"""The gateway's routing table: model name -> endpoint + policy, cached per process.

A model name is an endpoint's name or a model id its server serves (the probe's served_model). It resolves per
caller (`resolve`), among the endpoints the caller's token may call only, its own and its teams' first: another
tenant's endpoint named like, or serving, the same id never takes the caller's traffic nor makes its id ambiguous.

Built from the database in one query batch and reused while the gateway version is unchanged (read once per
request for the table and the token alike, from Redis or, in the lean /v1 app, from the bumps it follows:
speculation.gateway.freshness) and for at most MAX_AGE_S; while Redis is unreachable the table lives 0.25 s, so
a mode switch still reaches the next request soon after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleet.managed.models import ManagedServer
from fleet.models import Endpoint
from speculation.gateway.db import read
from speculation.gateway.freshness import Stamp, VersionReader
from speculation.models import CaptureSetting, Mode, SpeculationPolicy

logger = logging.getLogger(__name__)

MAX_AGE_S = 5.0
MISS_REBUILD_S = 0.5


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
    # Whose it is (fleet.permissions): a model id resolves among the caller's own and its teams' endpoints first.
    owner_id: int | None = None
    team_id: int | None = None
    # The fraction of its requests kept for training (speculation.gateway.capture); 0 unless the endpoint opted in.
    capture_rate: float = 0.0


@dataclass(frozen=True)
class RouteTable:
    """Every endpoint by name, and the endpoints serving each model id (each id by any number of them)."""

    by_name: dict[str, Route] = field(default_factory=dict)
    by_model: dict[str, tuple[Route, ...]] = field(default_factory=dict)

    def values(self):
        return self.by_name.values()


class Caller(Protocol):
    def may_call(self, endpoint_id: int) -> bool: ...

    def owns(self, owner_id: int | None, team_id: int | None) -> bool: ...


def resolve(table: RouteTable, model: str, caller: Caller) -> Route | None:
    """The endpoint `model` names for this caller, or None (unknown, not callable, or ambiguous).

    Among the endpoints the caller may call, its own and its teams' first, then (an admin's) everyone else's: in each
    tier an endpoint's name wins, then a model id served by exactly one endpoint; an id served by several endpoints
    of one tier routes to none of them (each stays reachable by its name; the probe reports the conflict).
    """
    named = table.by_name.get(model)
    if named is not None and not caller.may_call(named.endpoint_id):
        named = None
    serving = [r for r in table.by_model.get(model, ()) if r is not named and caller.may_call(r.endpoint_id)]
    for own in (True, False):
        if named is not None and caller.owns(named.owner_id, named.team_id) == own:
            return named
        tier = [r for r in serving if caller.owns(r.owner_id, r.team_id) == own]
        if tier:
            return tier[0] if len(tier) == 1 else None
    return None


def _build_table() -> RouteTable:
    from speculation.services.policies import resolve_path

    policies = {p.endpoint_id: p for p in SpeculationPolicy.objects.select_related("draft").all()}
    baselines = dict(ManagedServer.objects.values_list("endpoint_id", "baseline"))
    capture_rates = dict(CaptureSetting.objects.filter(enabled=True).values_list("endpoint_id", "sample_rate"))
    endpoints = list(Endpoint.objects.all())
    table = RouteTable()
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
            owner_id=endpoint.owner_id,
            team_id=endpoint.team_id,
            capture_rate=capture_rates.get(endpoint.pk, 0.0),
            **extra,
        )
        table.by_name[endpoint.name] = route
        if endpoint.served_model and endpoint.served_model != endpoint.name:
            table.by_model[endpoint.served_model] = (*table.by_model.get(endpoint.served_model, ()), route)
    return table


class RouteCache:
    """The table and the version reader of one event loop."""

    def __init__(self) -> None:
        self._table: RouteTable | None = None
        self._built: Stamp | None = None
        self._versions = VersionReader()
        self._lock = asyncio.Lock()

    def follow_bumps(self) -> None:
        """From now on learn of version bumps as they are published, instead of reading Redis per request."""
        self._versions.follow_bumps()

    async def stamp(self) -> Stamp:
        """The gateway version now (one Redis GET): read once per request, for the table and the token alike."""
        return await self._versions.stamp()

    async def table(self, stamp: Stamp | None = None) -> RouteTable:
        stamp = stamp or await self.stamp()
        if self._table is not None and self._built is not None and stamp.keeps(self._built, max_age_s=MAX_AGE_S):
            return self._table
        async with self._lock:
            if self._table is not None and self._built is not None and self._built.read_at >= stamp.read_at:
                return self._table  # another request rebuilt it while this one waited
            self._table = await read(_build_table)
            self._built = stamp
            return self._table

    async def lookup(self, model: str, caller: Caller, stamp: Stamp | None = None) -> Route | None:
        """The route `model` names for this caller (`resolve`)."""
        stamp = stamp or await self.stamp()
        route = resolve(await self.table(stamp), model, caller)
        if route is None and self._built is not None and time.monotonic() - self._built.read_at > MISS_REBUILD_S:
            # An unknown name may be an endpoint registered a moment ago (its version bump not seen yet).
            self._built = None
            route = resolve(await self.table(await self.stamp()), model, caller)
        return route

    async def current(self, route: Route, *, reread: bool = False) -> Route:
        """`route`'s endpoint as it is routed now (a switch or an edit may have moved it since `route` was looked up).
        `reread`: read the database even when no version bump was seen (at most every MISS_REBUILD_S): its server
        refused a connection, and the bump of a move may not have reached this process yet."""
        if reread and self._built is not None and time.monotonic() - self._built.read_at > MISS_REBUILD_S:
            self._built = None
        now = (await self.table()).by_name.get(route.name)
        return now if now is not None and now.endpoint_id == route.endpoint_id else route


_caches: dict[int, RouteCache] = {}


def route_cache() -> RouteCache:
    """One cache per event loop (an asyncio Redis client belongs to the loop that made it)."""
    loop_id = id(asyncio.get_running_loop())
    cache = _caches.get(loop_id)
    if cache is None:
        cache = _caches[loop_id] = RouteCache()
    return cache
