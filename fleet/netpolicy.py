"""Which URLs ACE may fetch: registering a URL makes the server fetch it, so it is checked twice.

At registration (`check_url`: scheme, shape, and every address the host resolves to) and again at connect
time by the adapters (`check_url` before each client is built), so a DNS answer that changed since
registration cannot point probing at the cloud metadata service.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlparse

from django.conf import settings

ALLOWED_SCHEMES = ("http", "https")


class URLNotAllowed(ValueError):
    """The URL is malformed, uses another scheme, or resolves outside ACE_ALLOWED_ENDPOINT_NETWORKS."""


def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise URLNotAllowed(f"host {host!r} does not resolve: {exc.strerror}") from exc
    return sorted({ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}, key=str)


def check_url(url: str) -> str:
    """Return the URL normalised (no trailing slash) or raise URLNotAllowed saying what is wrong."""
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
    del port
    networks = settings.ALLOWED_ENDPOINT_NETWORKS
    for address in _resolve(parsed.hostname):
        if not any(address in net for net in networks if net.version == address.version):
            raise URLNotAllowed(
                f"{parsed.hostname} resolves to {address}, outside the allowed networks "
                f"(ACE_ALLOWED_ENDPOINT_NETWORKS={','.join(str(n) for n in networks)})"
            )
    return url.strip().rstrip("/")
