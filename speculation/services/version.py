"""A cheap version number for the gateway's caches: its routing table (endpoints + policies) and its tokens
(token, scope, user, group: who may call what).

Every write that changes how a request is routed or who may make it bumps one Redis counter, and this process's
own generation at once; each gateway process compares both with those its cached entries were built at, so a
mode switch or a revoked token applies to the next request without a database query per request. When Redis
cannot be reached the gateway falls back to a short time-to-live (see speculation.gateway.freshness).
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings

logger = logging.getLogger(__name__)

ROUTING_VERSION_KEY = "ace:routing-version"
VERSION_CHANNEL = "ace:routing-version:bumps"  # the new value is published here: gateways following it read no Redis
# Bump and publish in one round trip (the value published is the value stored).
BUMP_LUA = "local v = redis.call('INCR', KEYS[1]); redis.call('PUBLISH', ARGV[1], v); return v"

_local_generation = 0


def local_generation() -> int:
    return _local_generation


def invalidate_local() -> None:
    """This process's gateway caches are rebuilt on their next request (even before the change commits)."""
    global _local_generation
    _local_generation += 1


def bump_routing_version() -> None:
    """Tell every gateway process that endpoints, policies or tokens changed. Never raises: the TTL covers a miss."""
    invalidate_local()
    publish_bump()


def publish_bump() -> None:
    """The Redis half of bump_routing_version: every other process learns of the change."""
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            client.eval(BUMP_LUA, 1, ROUTING_VERSION_KEY, VERSION_CHANNEL)
        finally:
            client.close()
    except redis.RedisError as exc:
        logger.info("routing version not bumped (redis unavailable: %s); gateways catch up by TTL", exc)
