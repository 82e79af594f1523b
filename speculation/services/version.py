"""A cheap version number for the gateway's routing table (endpoints + policies).

Every write that changes how a request is routed bumps one Redis counter; each gateway process compares
the counter with the one its cached table was built at, so a mode switch applies to the next request
without a database query per request. When Redis cannot be reached the gateway falls back to a short
time-to-live (see speculation.gateway.routes).
"""

from __future__ import annotations

import logging

import redis
from django.conf import settings

logger = logging.getLogger(__name__)

ROUTING_VERSION_KEY = "ace:routing-version"


def bump_routing_version() -> None:
    """Tell every gateway process that endpoints or policies changed. Never raises: the TTL covers a miss."""
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            client.incr(ROUTING_VERSION_KEY)
        finally:
            client.close()
    except redis.RedisError as exc:
        logger.info("routing version not bumped (redis unavailable: %s); gateways catch up by TTL", exc)
