"""Which addresses ACE may connect to: registering a URL makes the server fetch it.

Two checks, one rule (`check_address`):

- at registration, `check_url` checks the URL's shape and every address its host resolves to;
- at connect time, every outgoing HTTP client (probe, gateway, worker) uses `PinnedTransport` /
  `AsyncPinnedTransport`: the host is resolved once, each address is checked, and the socket connects to
  that checked address (the Host header and TLS SNI keep the name). A DNS answer that changes between the
  check and the connection (DNS rebinding) cannot reach anything the check did not see.

The rule: the address lies in ACE_ALLOWED_ENDPOINT_NETWORKS; it is not a cloud metadata address in any form
(IPv4, IPv6, IPv4-mapped / -compatible / 6to4 / NAT64 / Teredo), whatever the allowed networks say; and it is
not one of ACE's own services (Redis, the database, the web port) on loopback or on that service's host.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import ssl
import unicodedata
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import anyio
import certifi
import httpcore
import httpx
from django.conf import settings

from fleet.netstream import AsyncioBackend

ALLOWED_SCHEMES = ("http", "https")
DEFAULT_PORTS = {"http": 80, "https": 443}

DEFAULT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata services (and IPv6 link-local, the analogue of 169.254.0.0/16): refused even when an
# allowed network contains them.
METADATA_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",  # link-local: AWS, GCP, Azure, OpenStack, Oracle metadata (169.254.169.254)
        "100.100.100.200/32",  # Alibaba Cloud
        "192.0.0.192/32",  # Oracle Cloud (classic)
        "fd00:ec2::/64",  # AWS over IPv6: metadata fd00:ec2::254, DNS, time
        "fd20:ce::254/128",  # Google Cloud over IPv6
        "fd00:c1::a9fe:a9fe/128",  # Oracle Cloud over IPv6
        "fe80::/10",  # IPv6 link-local
    )
)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


class URLNotAllowed(ValueError):
    """The URL is malformed, uses another scheme, or resolves to an address the network policy refuses."""


class AddressNotAllowed(httpcore.ConnectError):
    """Raised at connect time (inside httpx, which re-raises it as httpx.ConnectError from this one)."""


@dataclass(frozen=True)
class OwnService:
    name: str
    host: str
    port: int


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (and so may reach through a translator or tunnel)."""
    found = []
    if address.ipv4_mapped is not None:
        found.append(address.ipv4_mapped)
    if address.sixtofour is not None:
        found.append(address.sixtofour)
    if address.teredo is not None:
        found.extend(address.teredo)
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found


def _canonical(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is its IPv4 address (that is what the socket reaches)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_metadata(address: IPAddress) -> bool:
    forms: list[IPAddress] = [address]
    if isinstance(address, ipaddress.IPv6Address):
        forms.extend(_embedded_ipv4(address))
    return any(form in net for form in forms for net in METADATA_NETWORKS if net.version == form.version)


def own_services() -> list[OwnService]:
    """ACE's own Redis, database and web server: no endpoint URL may point at them."""
    services = []
    redis = urlparse(settings.REDIS_URL)
    if redis.scheme in ("redis", "rediss"):
        services.append(OwnService("Redis", redis.hostname or "127.0.0.1", redis.port or 6379))
    database = settings.DATABASES["default"]
    if not database["ENGINE"].endswith("sqlite3"):
        services.append(OwnService("database", database.get("HOST") or "127.0.0.1", int(database.get("PORT") or 5432)))
    if settings.WEB_PORT:
        services.append(OwnService("web server", "127.0.0.1", settings.WEB_PORT))
    return services


@functools.lru_cache(maxsize=64)
def _service_addresses(host: str) -> frozenset[IPAddress]:
    try:
        return frozenset(_canonical(a) for a in resolve(host))
    except URLNotAllowed:
        return frozenset()


def refused_because(address: IPAddress, port: int) -> str:
    """Why ACE may not connect to address:port ("" when it may)."""
    address = _canonical(address)
    if is_metadata(address):
        return (
            "a cloud metadata or link-local address: outside the allowed networks whatever "
            "ACE_ALLOWED_ENDPOINT_NETWORKS lists"
        )
    networks = settings.ALLOWED_ENDPOINT_NETWORKS
    if not any(address in net for net in networks if net.version == address.version):
        return f"outside the allowed networks (ACE_ALLOWED_ENDPOINT_NETWORKS={','.join(str(n) for n in networks)})"
    local = address.is_loopback or address.is_unspecified
    for service in own_services():
        if port == service.port and (local or address in _service_addresses(service.host)):
            return f"ACE's own {service.name} (port {port}): never an endpoint"
    return ""


def check_address(address: IPAddress, port: int) -> None:
    """Raise URLNotAllowed saying why ACE may not connect to address:port."""
    why = refused_because(address, port)
    if why:
        raise URLNotAllowed(f"{address} port {port} is {why}")


def resolve(host: str) -> list[IPAddress]:
    """Every address `host` resolves to (an address literal is itself), in a stable order."""
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise URLNotAllowed(f"host {host!r} does not resolve: {getattr(exc, 'strerror', None) or exc}") from exc
    return sorted({ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}, key=str)


def checked_addresses(host: str, port: int) -> list[IPAddress]:
    """Resolve once and check every address; the caller connects only to what this returns."""
    addresses = resolve(host)
    for address in addresses:
        why = refused_because(address, port)
        if why and str(address) == host.strip("[]"):
            raise URLNotAllowed(f"{address} port {port} is {why}")
        if why:
            raise URLNotAllowed(f"{host} resolves to {address}, {why}")
    return addresses


_PERCENT_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")
# Unicode categories no URL of ACE's may hold: controls (CR, LF, TAB, NUL, ...), format characters (the bidi
# overrides such as U+202E, zero-width spaces), line and paragraph separators, and spaces of every width.
_REFUSED_CATEGORIES = {"Cc": "a control character", "Cf": "an invisible formatting character",
                       "Zl": "a line separator", "Zp": "a paragraph separator", "Zs": "a space"}  # fmt: skip


@functools.lru_cache(maxsize=1024)
def shape_problem(url: str) -> str:
    """What makes `url` unsafe to store, log or send as given ("" when nothing): urlparse drops CR, LF and TAB
    silently, so the URL it checks is not the one stored; httpx then refuses the stored one (InvalidURL) and a
    newline in it splits a log line."""
    for position, char in enumerate(url):
        what = _REFUSED_CATEGORIES.get(unicodedata.category(char))
        if what:
            return f"the URL holds {what} (U+{ord(char):04X}) at position {position + 1}"
    bad = _PERCENT_ESCAPE.search(url)
    if bad:
        return f"the URL holds a '%' not followed by two hex digits at position {bad.start() + 1}"
    return ""


def check_url(url: str) -> str:
    """Return the URL normalised (no trailing slash) or raise URLNotAllowed saying what is wrong."""
    problem = shape_problem(url.strip())
    if problem:
        raise URLNotAllowed(problem)
    try:
        parsed = urlparse(url.strip())
        port = parsed.port
    except ValueError as exc:
        raise URLNotAllowed(f"malformed URL: {exc}") from exc
    if parsed.scheme not in ALLOWED_SCHEMES:
        raise URLNotAllowed(f"scheme {parsed.scheme or '(none)'!r} is not allowed: use http or https")
    if not parsed.hostname:
        raise URLNotAllowed("the URL has no host")
    if parsed.username or parsed.password:
        raise URLNotAllowed("credentials in the URL are not allowed: put the API key in its own field")
    if parsed.query or parsed.fragment:
        raise URLNotAllowed("the base URL must not carry a query string or fragment")
    checked_addresses(parsed.hostname, port or DEFAULT_PORTS[parsed.scheme])
    return url.strip().rstrip("/")


def refusal(exc: BaseException) -> str:
    """The network policy's reason when `exc` (an httpx error) was a refused connection, else ""."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, AddressNotAllowed):
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    return ""


# --- connect-time enforcement: httpx transports whose sockets go only to checked addresses ------------------------


def _connect_in_order(addresses: list[IPAddress], connect: Any) -> Any:
    last: Exception | None = None
    for address in addresses:
        try:
            return connect(str(address))
        except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
            last = exc
    assert last is not None
    raise last


class _PolicyBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:  # fmt: skip
        try:
            addresses = checked_addresses(host, port)
        except URLNotAllowed as exc:
            raise AddressNotAllowed(f"network policy: {exc}") from None
        return _connect_in_order(
            addresses, lambda ip: self._inner.connect_tcp(ip, port, timeout, local_address, socket_options)
        )

    def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise AddressNotAllowed("network policy: unix sockets are not allowed")

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


class _AsyncPolicyBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = AsyncioBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:  # fmt: skip
        try:
            addresses = await anyio.to_thread.run_sync(checked_addresses, host, port)
        except URLNotAllowed as exc:
            raise AddressNotAllowed(f"network policy: {exc}") from None
        last: Exception | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(str(address), port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(self, path: str, timeout: float | None = None, socket_options: Any = None) -> Any:
        raise AddressNotAllowed("network policy: unix sockets are not allowed")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def ssl_context() -> ssl.SSLContext:
    """TLS verified against certifi's CA bundle, for every outgoing client."""
    return ssl.create_default_context(cafile=certifi.where())


def _pool_options(limits: httpx.Limits) -> dict[str, Any]:
    return {
        "ssl_context": ssl_context(),
        "max_connections": limits.max_connections,
        "max_keepalive_connections": limits.max_keepalive_connections,
        "keepalive_expiry": limits.keepalive_expiry,
    }


class PinnedTransport(httpx.HTTPTransport):
    """httpx's transport with sockets connected only to addresses the network policy allowed. No proxies."""

    def __init__(self, *, limits: httpx.Limits = DEFAULT_LIMITS) -> None:
        super().__init__(limits=limits, trust_env=False)
        self._pool = httpcore.ConnectionPool(**_pool_options(limits), network_backend=_PolicyBackend())


class AsyncPinnedTransport(httpx.AsyncHTTPTransport):
    """The async twin of PinnedTransport (the gateway's upstream client)."""

    def __init__(self, *, limits: httpx.Limits = DEFAULT_LIMITS) -> None:
        super().__init__(limits=limits, trust_env=False)
        self._pool = httpcore.AsyncConnectionPool(**_pool_options(limits), network_backend=_AsyncPolicyBackend())
