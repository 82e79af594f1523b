"""fleet.http1: the relay's lean client reuses connections, hands bodies on as they arrive, tells a dropped
connection from an answer, and keeps to the network policy."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from fleet import http1, netpolicy
from tests.fleet.test_netstream import Server as LoopbackServer
from tests.fleet.test_netstream import _tls_contexts

BODY = b'{"ok":true}'


class Server(LoopbackServer):
    """A loopback server that reads each request's head and body and writes what `answer` returns for it (None:
    close without answering); `close` closes after each answer. Counts connections and keeps the requests."""

    def __init__(self, answer=None, *, close: bool = False, tls=None) -> None:
        super().__init__(close=close, tls=tls)
        self.answer = answer or (lambda request: ok(BODY))
        self.requests: list[bytes] = []

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}/v1/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                parts = self.answer(request)
                if parts is None:
                    break
                for part in [parts] if isinstance(parts, bytes) else parts:
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                        continue
                    writer.write(part)
                    await writer.drain()
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def ok(body: bytes, *, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _post(url: str, content: bytes = b"{}", headers: dict[str, str] | None = None) -> http1.Response:
    return await http1.pool().post(url, content=content, headers=headers or {"Content-Type": "application/json"})


def test_it_sends_the_request_and_reuses_one_kept_alive_connection():
    async def run():
        async with Server() as server:
            bodies = []
            for _ in range(3):
                response = await _post(server.url, b'{"prompt":"x"}', {"Authorization": "Bearer k"})
                bodies.append((response.status_code, response.headers.get("Content-Type"), await response.aread()))
            return bodies, server

    bodies, server = asyncio.run(run())
    assert bodies == [(200, "application/json", BODY)] * 3
    assert server.connections == 1
    head, _, body = server.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert f"Host: 127.0.0.1:{server.port}".encode() in head
    assert b"Content-Length: 14" in head and b"Authorization: Bearer k" in head
    assert body == b'{"prompt":"x"}'


def test_a_chunked_stream_is_handed_on_piece_by_piece_as_it_arrives():
    events = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]

    def answer(request):
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        return [head, chunk(events[0]), 0.05, chunk(events[1]), 0.05, chunk(events[2]) + b"0\r\n\r\n"]

    async def run():
        async with Server(answer) as server:
            response = await _post(server.url)
            pieces = [piece async for piece in response.aiter_raw()]
            again = await (await _post(server.url)).aread()
            return pieces, again, server.connections

    pieces, again, connections = asyncio.run(run())
    assert pieces == events  # three reads, one per event: nothing waited for the end of the body
    assert again == b"".join(events)
    assert connections == 1  # the chunked body's end was found: the connection was kept


def test_a_body_without_length_ends_when_the_server_closes():
    async def run():
        async with Server(
            lambda r: b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + BODY, close=True
        ) as s:
            return await (await _post(s.url)).aread()

    assert asyncio.run(run()) == BODY


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def run():
        async with Server(close=True) as server:
            first = await (await _post(server.url)).aread()
            await asyncio.sleep(0.05)  # the server's FIN arrives while the connection waits in the pool
            second = await (await _post(server.url)).aread()
            return first, second, server.connections

    first, second, connections = asyncio.run(run())
    assert first == second == BODY
    assert connections == 2


def test_a_connection_closed_unanswered_is_a_protocol_error_the_relay_may_send_again():
    async def run():
        async with Server(lambda request: None) as server:
            await _post(server.url)

    with pytest.raises(httpx.RemoteProtocolError):
        asyncio.run(run())


def test_a_body_cut_off_mid_way_is_a_read_error_and_the_connection_is_dropped():
    async def run():
        async with Server(lambda r: [ok(BODY)[:-4]], close=True) as server:
            response = await _post(server.url)
            return [piece async for piece in response.aiter_raw()]

    with pytest.raises(httpx.ReadError):
        asyncio.run(run())


def test_a_response_closed_before_its_end_does_not_leave_its_rest_to_the_next_request():
    def answer(request):
        head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        return [head, chunk(b"data: 1\n\n"), 0.1, chunk(b"data: 2\n\n") + b"0\r\n\r\n"]

    async def run():
        async with Server(answer) as server:
            response = await _post(server.url)
            async for _ in response.aiter_raw():
                break  # the client went away after the first event
            await response.aclose()
            second = await (await _post(server.url)).aread()
            return second, server.connections

    second, connections = asyncio.run(run())
    assert second == b"data: 1\n\ndata: 2\n\n"
    assert connections == 2


def test_a_server_that_does_not_answer_in_time_is_a_read_timeout(monkeypatch):
    monkeypatch.setattr(http1, "READ_TIMEOUT_S", 0.2)

    async def run():
        async with Server(lambda request: [5.0]) as server:
            await _post(server.url)

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(run())


def test_a_refused_connection_is_a_connect_error():
    async def run():
        async with Server() as server:
            url = server.url
        await _post(url)

    with pytest.raises(httpx.ConnectError):
        asyncio.run(run())


def test_an_address_the_network_policy_refuses_is_never_connected_and_says_why():
    async def run():
        await _post("http://169.254.169.254/v1/completions")

    with pytest.raises(httpx.ConnectError) as caught:
        asyncio.run(run())
    assert "metadata" in netpolicy.refusal(caught.value)


@pytest.mark.parametrize("name,value", [("X-Key", "a\r\nInjected: 1"), ("X-Key", "a\nb"), ("Bad:Name", "v")])
def test_a_header_http_cannot_carry_is_refused_before_anything_is_sent(name, value):
    async def run():
        async with Server() as server:
            try:
                await _post(server.url, headers={name: value})
            finally:
                await asyncio.sleep(0.01)
            return server.requests

    with pytest.raises(httpx.LocalProtocolError):
        asyncio.run(run())


def test_it_speaks_tls_checking_the_servers_certificate(tmp_path, monkeypatch):
    server_tls, client_tls = _tls_contexts(tmp_path)
    monkeypatch.setattr(netpolicy, "ssl_context", lambda: client_tls)

    async def run():
        async with Server(tls=server_tls) as server:
            return await (await _post(server.url)).aread()

    assert asyncio.run(run()) == BODY
    monkeypatch.setattr(netpolicy, "ssl_context", lambda: __import__("ssl").create_default_context())
    with pytest.raises(httpx.ConnectError):  # a certificate the client does not trust
        asyncio.run(run())


def test_a_fast_upstream_is_not_read_far_ahead_of_a_slow_reader():
    size = 8 * http1.HIGH_WATER
    body = b"x" * size

    async def run():
        async with Server(lambda request: ok(body)) as server:
            response = await _post(server.url)
            await asyncio.sleep(0.2)  # the server has written everything it could
            ahead = response._buffered
            received = b"".join([piece async for piece in response.aiter_raw()])
            return ahead, received

    ahead, received = asyncio.run(run())
    assert ahead <= 2 * http1.HIGH_WATER  # paused at the high-water mark (plus what one read brings)
    assert received == body


def test_a_url_becomes_its_host_header_request_target_and_pool_key():
    plain = http1.target("http://[::1]:8000/v1/completions")
    assert (plain.netloc, plain.path, plain.key) == (b"[::1]:8000", b"/v1/completions", ("http", "::1", 8000))
    named = http1.target("https://exämple.com/v1/chat/completions?x=1")
    assert (named.netloc, named.path, named.port) == (b"xn--exmple-cua.com", b"/v1/chat/completions?x=1", 443)
    with pytest.raises(httpx.UnsupportedProtocol):
        http1.target("ftp://example.com/")
