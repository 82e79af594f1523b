"""fleet.netstream: the asyncio backend under the gateway's upstream pool relays, reuses, times out and speaks TLS."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl

import httpcore
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fleet.netpolicy import AsyncPinnedTransport
from fleet.netstream import AsyncioBackend

BODY = b'{"ok":true}'


class Server:
    """A loopback HTTP/1.1 server: answers each request with BODY, keeps the connection open unless `close`, never
    answers at all when `silent`; counts the connections it accepted."""

    def __init__(self, *, close: bool = False, silent: bool = False, tls: ssl.SSLContext | None = None) -> None:
        self.close, self.silent, self.tls = close, silent, tls
        self.connections = 0
        self.port = 0

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if self.silent:
                    await reader.read()  # until the client gives up and closes
                    break
                head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(BODY)}\r\n\r\n"
                writer.write(head.encode() + BODY)
                await writer.drain()
                if self.close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def test_it_relays_requests_over_one_kept_alive_connection():
    async def run():
        async with Server() as server, httpx.AsyncClient(transport=AsyncPinnedTransport()) as http:
            bodies = [(await http.get(f"http://127.0.0.1:{server.port}/v1/models")).content for _ in range(3)]
            return bodies, server.connections

    bodies, connections = asyncio.run(run())
    assert bodies == [BODY] * 3
    assert connections == 1


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    async def run():
        async with Server(close=True) as server, httpx.AsyncClient(transport=AsyncPinnedTransport()) as http:
            first = await http.get(f"http://127.0.0.1:{server.port}/")
            await asyncio.sleep(0.05)  # the server's FIN arrives while the connection waits in the pool
            second = await http.get(f"http://127.0.0.1:{server.port}/")
            return first.content, second.content, server.connections

    first, second, connections = asyncio.run(run())
    assert first == second == BODY
    assert connections == 2


def test_a_server_that_does_not_answer_in_time_is_a_read_timeout():
    async def run():
        async with Server(silent=True) as server, httpx.AsyncClient(transport=AsyncPinnedTransport()) as http:
            await http.get(f"http://127.0.0.1:{server.port}/", timeout=httpx.Timeout(5.0, read=0.2))

    with pytest.raises(httpx.ReadTimeout):
        asyncio.run(run())


def test_a_refused_connection_is_a_connect_error():
    async def run():
        async with Server() as server:
            port = server.port
        async with httpx.AsyncClient(transport=AsyncPinnedTransport()) as http:
            await http.get(f"http://127.0.0.1:{port}/")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(run())


def _tls_contexts(tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a self-signed certificate for 127.0.0.1, and a client context trusting only it."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_path, key_path)
    return server, ssl.create_default_context(cafile=str(cert_path))


def test_it_speaks_tls_checking_the_servers_certificate(tmp_path):
    server_tls, client_tls = _tls_contexts(tmp_path)

    async def run(client_context: ssl.SSLContext):
        async with Server(tls=server_tls) as server:
            pool = httpcore.AsyncConnectionPool(ssl_context=client_context, network_backend=AsyncioBackend())
            async with pool:
                response = await pool.request("GET", f"https://127.0.0.1:{server.port}/")
                return response.content

    assert asyncio.run(run(client_tls)) == BODY
    with pytest.raises(httpcore.ConnectError):  # a certificate the client does not trust
        asyncio.run(run(ssl.create_default_context()))
