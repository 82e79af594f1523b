"""The network policy holds where it matters: at the address a socket actually connects to.

Each test reproduces an attack first: a metadata address inside an allowed range, ACE's own
Redis on loopback, and a name that resolves differently at connect time than when it was checked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import redis

from ace.env import env_networks
from fleet import netpolicy
from fleet.adapters import FailureKind, adapter_for
from fleet.netpolicy import AsyncPinnedTransport, PinnedTransport, URLNotAllowed, check_url
from tests.support.server_shapes import openai_routes

EVERYTHING = "0.0.0.0/0,::/0"

METADATA_FORMS = [
    "http://[fd00:ec2::254]/",  # AWS IMDS over IPv6: inside fc00::/7, accepted before
    "http://169.254.169.254/latest/meta-data/",
    "http://100.100.100.200/",  # Alibaba Cloud
    "http://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "http://[::ffff:a9fe:a9fe]/",  # IPv4-mapped, hex
    "http://[64:ff9b::a9fe:a9fe]/",  # NAT64
    "http://[2002:a9fe:a9fe::1]/",  # 6to4
    "http://[::169.254.169.254]/",  # IPv4-compatible
    "http://2852039166/",  # 169.254.169.254 as one decimal number
    "http://[fe80::1]/",  # IPv6 link-local
]


@pytest.fixture
def allow_everything(settings):
    settings.ALLOWED_ENDPOINT_NETWORKS = env_networks("UNSET_FOR_TEST", EVERYTHING)


@pytest.mark.parametrize("url", METADATA_FORMS)
def test_metadata_addresses_are_refused_in_every_form_even_inside_an_allowed_range(allow_everything, url):
    with pytest.raises(URLNotAllowed, match="cloud metadata or link-local"):
        check_url(url)


def test_the_default_networks_refuse_aws_ipv6_metadata_although_fc00_is_allowed(settings):
    assert ipaddress.ip_address("fd00:ec2::254") in ipaddress.ip_network("fc00::/7")
    with pytest.raises(URLNotAllowed, match="outside the allowed networks"):
        check_url("http://[fd00:ec2::254]/")
    # a neighbour in the same ULA range stays allowed
    assert check_url("http://[fd12:3456::1]:8000/") == "http://[fd12:3456::1]:8000"


def test_ace_own_redis_is_refused_on_loopback_and_a_probe_never_connects(redis_server):
    # given ACE's own Redis on loopback (a probe's POST must not reach it)
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    client = redis.Redis.from_url(redis_server.url)
    before = int(client.info("stats")["total_connections_received"])
    # when it is registered as an endpoint, or a client connects to it through the pinned transport
    with pytest.raises(URLNotAllowed, match="ACE's own Redis"):
        check_url(f"http://127.0.0.1:{port}")
    with pytest.raises(URLNotAllowed, match="ACE's own Redis"):
        check_url(f"http://localhost:{port}/")
    report = adapter_for("openai", base_url=f"http://127.0.0.1:{port}").probe()
    with httpx.Client(transport=PinnedTransport()) as http, pytest.raises(httpx.ConnectError) as caught:
        http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "FLUSHALL"})
    # then nothing reached it
    assert report.fatal.kind == FailureKind.NOT_ALLOWED
    assert "ACE's own Redis" in netpolicy.refusal(caught.value)
    after = int(client.info("stats")["total_connections_received"])
    assert after == before  # the INFO client reuses its one pooled connection: no other connection arrived


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_ace_own_web_and_database_ports_are_refused(settings):
    settings.WEB_PORT = 18123
    settings.DATABASES = {**settings.DATABASES, "default": {**settings.DATABASES["default"],
                          "ENGINE": "django.db.backends.postgresql", "HOST": "127.0.0.1", "PORT": "15432"}}  # fmt: skip
    with pytest.raises(URLNotAllowed, match="ACE's own web server"):
        check_url("http://127.0.0.1:18123/")
    with pytest.raises(URLNotAllowed, match="ACE's own database"):
        check_url("http://[::1]:15432/")
    assert check_url("http://127.0.0.1:18124") == "http://127.0.0.1:18124"


class _Rogue:
    """An HTTP server on 127.0.0.2 (outside the allowed 127.0.0.1/32 of these tests) that counts requests."""

    def __init__(self) -> None:
        self.hits = 0
        rogue = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                rogue.hits += 1
                body = b'{"object":"list","data":[{"id":"stolen"}]}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.2", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def rebinding(settings, monkeypatch):
    """`model.rebind.test` resolves to 127.0.0.1 on the first lookup and to 127.0.0.2 (refused) afterwards."""
    settings.ALLOWED_ENDPOINT_NETWORKS = env_networks("UNSET_FOR_TEST", "127.0.0.1/32")
    real = socket.getaddrinfo
    lookups: list[str] = []

    def fake(host, port, *args, **kwargs):
        if host != "model.rebind.test":
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        address = "127.0.0.1" if len(lookups) == 1 else "127.0.0.2"
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port or 0))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    rogue = _Rogue()
    yield rogue, lookups
    rogue.close()


def test_a_name_that_resolves_elsewhere_at_connect_time_is_refused_by_the_probe(rebinding):
    rogue, lookups = rebinding
    url = f"http://model.rebind.test:{rogue.port}"
    # when the probe checks the name (127.0.0.1: allowed), then connects (the name now says 127.0.0.2)
    report = adapter_for("openai", base_url=url).probe()
    # then the connection is refused by the policy and the rogue server saw nothing
    assert len(lookups) >= 2
    assert report.fatal.kind == FailureKind.NOT_ALLOWED
    assert "127.0.0.2" in report.fatal.message and "outside the allowed networks" in report.fatal.message
    assert rogue.hits == 0


def test_the_gateway_and_worker_clients_refuse_a_rebound_name(rebinding):
    rogue, lookups = rebinding
    url = f"http://model.rebind.test:{rogue.port}/v1/models"
    assert check_url(url.rsplit("/v1", 1)[0])  # the check at registration passes (first lookup)

    async def gateway_client() -> httpx.Response:
        async with httpx.AsyncClient(transport=AsyncPinnedTransport()) as http:
            return await http.get(url)

    with pytest.raises(httpx.ConnectError) as caught:
        asyncio.run(gateway_client())
    assert "127.0.0.2" in netpolicy.refusal(caught.value)

    from speculation.worker.upstream import http

    with pytest.raises(httpx.ConnectError) as caught:
        http().get(url)
    assert "outside the allowed networks" in netpolicy.refusal(caught.value)
    assert rogue.hits == 0


def test_an_allowed_name_connects_to_the_checked_address_keeping_the_host_header(http_stub, monkeypatch):
    stub = http_stub(openai_routes())
    port = int(stub.base_url.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    lookups: list[str] = []

    def fake(host, port_, *args, **kwargs):
        if host == "model.internal.test":
            lookups.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", port_ or 0))]
        return real(host, port_, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    with httpx.Client(transport=PinnedTransport()) as http:
        response = http.get(f"http://model.internal.test:{port}/v1/models")
    assert response.status_code == 200
    assert stub.requests[-1].headers["host"] == f"model.internal.test:{port}"
    assert lookups == ["model.internal.test"]  # resolved once, by the policy; the socket got the address


@pytest.mark.django_db
def test_the_gateway_answers_a_rebound_endpoint_with_a_502_and_never_reaches_it(
    rebinding, redis_server, client, django_user_model
):
    from rest_framework.authtoken.models import Token

    from fleet.models import Endpoint, EndpointStatus
    from speculation.services.version import bump_routing_version

    rogue, lookups = rebinding
    # given an endpoint whose name checked fine at registration (first lookup) and now points elsewhere
    url = f"http://model.rebind.test:{rogue.port}"
    assert check_url(url) == url
    Endpoint.objects.create(name="rebound", base_url=url, status=EndpointStatus.READY)
    bump_routing_version()
    key = Token.objects.create(user=django_user_model.objects.create_superuser("gw", password="pw-for-tests")).key
    # when a client calls it through the gateway (off mode: a plain relay)
    response = client.post(
        "/v1/completions",
        data={"model": "rebound", "prompt": "hi", "max_tokens": 1},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )
    # then the connection is refused, the answer says so without the address, and nothing reached the rogue
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "refused by ACE's network policy" in message and "127.0.0.2" not in message
    assert rogue.hits == 0 and len(lookups) >= 2
