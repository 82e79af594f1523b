"""A lean HTTP/1.1 client for the gateway's relay: asyncio protocols, httptools' C response parser, a keep-alive pool.

An off-mode request is relayed byte for byte, so the relay needs no more of a client than: write one request, parse
the status and headers, hand the body on as it arrives (de-chunked, not decoded), and keep the connection for the
next request. httpx/httpcore/h11 do that in pure Python through several layers; this does it with the parser uvicorn
already uses for ACE's own side (speculation.bench.gateway_overhead measures both). Errors are httpx's exception
classes, so callers handle them as they would httpx's. Sockets connect only to addresses the network policy
checked at connect time (fleet.netpolicy), as with AsyncPinnedTransport. Everything else (the prod path, probes)
keeps using httpx.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from urllib.parse import urlsplit

import httptools
import httpx

from fleet import netpolicy

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # long generations stream for minutes
KEEPALIVE_S = 60.0  # an idle connection older than this is closed rather than reused
MAX_IDLE_PER_HOST = 256
HIGH_WATER = 1 << 20  # bytes read ahead of the relay before the socket stops being read
_FORBIDDEN = frozenset("\r\n\0")


@dataclass(frozen=True)
class Target:
    """Where a URL goes: the pool key, the connect address and the request line's target."""

    scheme: str
    host: str
    port: int
    netloc: bytes
    path: bytes

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.scheme, self.host, self.port)


@lru_cache(maxsize=1024)
def target(url: str) -> Target:
    """The URL parsed once (the relay sends to few URLs, many times)."""
    parts = urlsplit(url)
    if parts.scheme not in netpolicy.DEFAULT_PORTS or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"not an http(s) URL: {url!r}")
    port = parts.port or netpolicy.DEFAULT_PORTS[parts.scheme]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    netloc = parts.netloc.rpartition("@")[2]  # never credentials (netpolicy.check_url refuses them anyway)
    host_header = netloc.encode() if netloc.isascii() else netloc.encode("idna")
    return Target(parts.scheme, parts.hostname, port, host_header, path.encode())


class Headers:
    """A response's headers, looked up by lower-case name."""

    def __init__(self) -> None:
        self._items: dict[str, str] = {}

    def add(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self._items[key] = f"{self._items[key]}, {text}" if key in self._items else text

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._items.get(name.lower(), default)

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._items


class Response:
    """One response: status and headers once parsed, the body as it arrives (aiter_raw) or whole (aread)."""

    def __init__(self, connection: _Connection) -> None:
        self.status_code = 0
        self.headers = Headers()
        self._connection: _Connection | None = connection
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: httpx.HTTPError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._content: bytes | None = None

    # --- fed by the connection ---------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: httpx.HTTPError) -> None:
        if not self._complete:
            self._error = error
        self._wake()

    # --- read by the caller ------------------------------------------------------------------------------------
    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                await self._waiter
        except TimeoutError:
            raise httpx.ReadTimeout("no data from the endpoint within the read timeout") from None
        finally:
            self._waiter = None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (transfer encoding removed, content encoding kept)."""
        if self._content is not None:
            yield self._content
            return
        try:
            while True:
                while self._chunks:
                    chunk = self._chunks.popleft()
                    self._buffered -= len(chunk)
                    if self._connection is not None and self._buffered < HIGH_WATER // 2:
                        self._connection.resume()
                    yield chunk
                if self._error is not None:
                    raise self._error
                if self._complete:
                    return
                await self._wait()
        finally:
            await self.aclose()

    async def aread(self) -> bytes:
        if self._content is None:
            self._content = b"".join([chunk async for chunk in self.aiter_raw()])
        return self._content

    async def aclose(self) -> None:
        """Done with the response: its connection goes back to the pool if the body was read to its end, else it
        is closed (the rest of the body would be read by the next request)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.release(reusable=self._complete and self._error is None)


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request at a time; its response is parsed as bytes arrive."""

    def __init__(self, pool: Pool, key: tuple[str, str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.headers_done: asyncio.Future[None] | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._paused = False
        self._keep_alive = True
        self._until_close = False  # a body without Content-Length or chunked framing ends when the server closes

    # --- asyncio.Protocol ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # bytes nobody asked for: the connection cannot be trusted for a next request
            self._abort(httpx.RemoteProtocolError("the endpoint sent data before a request"))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._abort(httpx.RemoteProtocolError(f"malformed response from the endpoint: {exc}"))
        except httptools.HttpParserUpgrade:
            self._abort(httpx.RemoteProtocolError("the endpoint switched protocols"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.response is not None and not self.response._complete:
            if self.headers_done is None or not self.headers_done.done():
                error: httpx.HTTPError = httpx.RemoteProtocolError(
                    "the endpoint closed the connection without a response"
                )
            elif self._until_close and exc is None:
                self.response._finish()
                return
            else:
                error = httpx.ReadError(f"the endpoint closed the connection mid-response: {exc or 'EOF'}")
            self._fail(error)

    # --- httptools callbacks ---------------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.response.headers.add(name, value)  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        response = self.response
        response.status_code = self.parser.get_status_code()  # type: ignore[union-attr]
        self._keep_alive = self.parser.should_keep_alive()
        headers = response.headers  # type: ignore[union-attr]
        chunked = "chunked" in (headers.get("transfer-encoding") or "").lower()
        self._until_close = not chunked and "content-length" not in headers
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.response._feed(body)  # type: ignore[union-attr]
        if self.response._buffered > HIGH_WATER and not self._paused:  # type: ignore[union-attr]
            self._paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        self.response._finish()  # type: ignore[union-attr]

    # --- the pool's side -------------------------------------------------------------------------------------------
    def _fail(self, error: httpx.HTTPError) -> None:
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(error)
        if self.response is not None:
            self.response._fail(error)

    def _abort(self, error: httpx.HTTPError) -> None:
        self._fail(error)
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    def usable(self) -> bool:
        fresh = time.monotonic() - self.idle_since < KEEPALIVE_S
        return fresh and not self.closed and self.transport is not None and not self.transport.is_closing()

    async def request(self, head: bytes, content: bytes) -> Response:
        self.response = Response(self)
        self.parser = httptools.HttpResponseParser(self)
        self.headers_done = asyncio.get_running_loop().create_future()
        self.transport.writelines((head, content))  # type: ignore[union-attr]
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                await self.headers_done
        except TimeoutError:
            self._abort(httpx.ReadTimeout("no response from the endpoint within the read timeout"))
            raise httpx.ReadTimeout("no response from the endpoint within the read timeout") from None
        except BaseException:
            self.release(reusable=False)
            raise
        return self.response

    def release(self, *, reusable: bool) -> None:
        self.response = None
        if reusable and self._keep_alive and self.usable():
            self.idle_since = time.monotonic()
            self.pool._put(self)
        elif self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class Pool:
    """Keep-alive connections per (scheme, host, port), for one event loop."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl = ssl_context

    def _put(self, connection: _Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) < MAX_IDLE_PER_HOST:
            idle.append(connection)
        else:
            connection.closed = True
            connection.transport.close()  # type: ignore[union-attr]

    async def _connect(self, where: Target) -> _Connection:
        try:
            addresses = await asyncio.to_thread(netpolicy.checked_addresses, where.host, where.port)
        except netpolicy.URLNotAllowed as exc:
            refused = netpolicy.AddressNotAllowed(f"network policy: {exc}")
            raise httpx.ConnectError(str(refused)) from refused
        except OSError as exc:
            raise httpx.ConnectError(f"cannot resolve {where.host}: {exc}") from exc
        if where.scheme == "https" and self._ssl is None:
            self._ssl = netpolicy.ssl_context()
        tls = {"ssl": self._ssl, "server_hostname": where.host} if where.scheme == "https" else {}
        loop = asyncio.get_running_loop()
        last: Exception | None = None
        for address in addresses:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    _, protocol = await loop.create_connection(
                        lambda: _Connection(self, where.key), str(address), where.port, **tls
                    )
                return protocol  # type: ignore[return-value]
            except (OSError, TimeoutError, ssl.SSLError) as exc:
                last = exc
        kind = httpx.ConnectTimeout if isinstance(last, TimeoutError) else httpx.ConnectError
        raise kind(f"cannot connect to {where.host}:{where.port}: {last or 'no address'}") from last

    async def post(self, url: str, *, content: bytes, headers: Mapping[str, str]) -> Response:
        """Send a POST and return once the response's headers are in (read its body with aread or aiter_raw).
        A pooled connection the server closed as the request went out raises RemoteProtocolError before any
        response (the caller may send again: nothing was answered)."""
        where = target(url)
        lines = [b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n" % (where.path, where.netloc, len(content))]
        for name, value in headers.items():
            if _FORBIDDEN.intersection(name) or _FORBIDDEN.intersection(value) or ":" in name or not name.isascii():
                raise httpx.LocalProtocolError(f"header {name!r} has a character HTTP does not allow")
            lines.append(b"%s: %s\r\n" % (name.encode(), value.encode()))
        lines.append(b"\r\n")
        head = b"".join(lines)
        idle = self._idle.get(where.key)
        connection = None
        while idle:
            candidate = idle.pop()
            if candidate.usable():
                connection = candidate
                break
            candidate.release(reusable=False)
        if connection is None:
            connection = await self._connect(where)
        return await connection.request(head, content)


_pools: dict[int, tuple[asyncio.AbstractEventLoop, Pool]] = {}


def pool() -> Pool:
    """This event loop's pool (a pool's connections belong to the loop that opened them)."""
    loop = asyncio.get_running_loop()
    found = _pools.get(id(loop))
    if found is None or found[0] is not loop:
        for key, (other, _) in list(_pools.items()):  # closed loops' pools (finished threads, test cases)
            if other.is_closed():
                del _pools[key]
        found = _pools[id(loop)] = (loop, Pool())
    return found[1]
