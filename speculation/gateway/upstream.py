"""One pooled httpx.AsyncClient per event loop for everything the gateway sends to model servers.

Its sockets connect only to addresses the network policy checked at connect time (fleet.netpolicy).

The relay (speculation.gateway.passthrough) sends through `send`: straight to the client's pooled transport, without
what the client adds per request and the gateway never uses (auth, redirects, cookies, event hooks, proxies from the
environment, its log line, base URL merging): about 0.3 ms less per off-mode request
(speculation.bench.gateway_overhead).
"""

from __future__ import annotations

import asyncio

import httpx
from httpx import ByteStream

from fleet.netpolicy import AsyncPinnedTransport

# Long generations stream for minutes; connecting must be quick.
TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=30.0, pool=30.0)
LIMITS = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=60.0)
_TIMEOUTS = TIMEOUT.as_dict()
MAX_URLS = 1024

_urls: dict[str, httpx.URL] = {}  # parsed once: httpx parses a str URL on every request

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


def request(method: str, url: str, *, content: bytes, headers: dict[str, str]) -> httpx.Request:
    """A request for `send`, with the client's timeouts and the headers httpx would add (Host, Content-Length),
    built as a stream so that httpx does not inspect the content again."""
    parsed = _urls.get(url)
    if parsed is None:
        if len(_urls) >= MAX_URLS:
            _urls.clear()
        parsed = _urls[url] = httpx.URL(url)
    listed: list[tuple[str | bytes, str | bytes]] = [(b"Host", parsed.netloc)]
    listed += [(b"Content-Length", b"%d" % len(content)), *headers.items()]
    return httpx.Request(method, parsed, stream=ByteStream(content), headers=listed, extensions={"timeout": _TIMEOUTS})


async def send(request: httpx.Request, *, stream: bool) -> httpx.Response:
    """Send through the pool, as client().send would (`stream`: False reads the whole body before returning)."""
    response = await _pooled()[1].handle_async_request(request)
    response.request = request
    if not stream:
        try:
            await response.aread()
        finally:
            await response.aclose()
    return response
