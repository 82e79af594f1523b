"""One pooled httpx.AsyncClient per event loop for everything the gateway sends to model servers.

Its sockets connect only to addresses the network policy checked at connect time (fleet.netpolicy).

The relay of off and shadow requests (speculation.gateway.passthrough) sends through fleet.http1 instead.
"""

from __future__ import annotations

import asyncio

import httpx

from fleet.netpolicy import AsyncPinnedTransport

# Long generations stream for minutes; connecting must be quick.
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=60.0)

_clients: dict[int, tuple[httpx.AsyncClient, AsyncPinnedTransport]] = {}


def _pooled() -> tuple[httpx.AsyncClient, AsyncPinnedTransport]:
    loop_id = id(asyncio.get_running_loop())
    found = _clients.get(loop_id)
    if found is None or found[0].is_closed:
        transport = AsyncPinnedTransport(limits=LIMITS)
        found = _clients[loop_id] = (httpx.AsyncClient(timeout=TIMEOUT, transport=transport), transport)
    return found


def client() -> httpx.AsyncClient:
    return _pooled()[0]
