"""The worker's HTTP client to the model servers: one pooled client for the process, and an endpoint's headers.

Every call from the worker to a server (remote scoring, baseline and cost calibrations, shadow's scoring replays)
goes through it; its sockets reach only the addresses the network policy checked at connect time
(fleet.netpolicy.PinnedTransport).
"""

from __future__ import annotations

import httpx

from fleet.models import Endpoint
from fleet.netpolicy import PinnedTransport

_client: httpx.Client | None = None


def http() -> httpx.Client:
    global _client
    if _client is None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        _client = httpx.Client(transport=PinnedTransport(limits=limits))
    return _client


def headers(endpoint: Endpoint) -> dict[str, str]:
    """The endpoint's API key as a bearer token (none when it has no key)."""
    key = endpoint.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}
