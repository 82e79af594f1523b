"""One client adapter per server kind, behind one protocol (`ServerAdapter`). Pick one with `get_adapter`.

At request time the same server kind speaks through its wire format (`wire_for(kind)`, fleet.adapters.wire):
pure request builders and answer parsers; the caller sends them with its own HTTP client."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings

from fleet.adapters.base import (
    CANARY_TEXT,
    REFERENCE_TOP_N,
    FailureKind,
    ProbeError,
    ProbeReport,
    ServerAdapter,
    fingerprint,
)
from fleet.adapters.openai import OpenAICompatibleAdapter
from fleet.adapters.semantics import RequestSemantics
from fleet.adapters.sglang import SglangAdapter
from fleet.adapters.vllm import VllmAdapter
from fleet.adapters.wire import (
    Continued,
    PositionScores,
    Scored,
    ServerWire,
    TokenIdsSeen,
    TokenLogprob,
    Unsupported,
    WireError,
    WireRequest,
)

if TYPE_CHECKING:
    from fleet.models import Endpoint

ADAPTERS: dict[str, type[OpenAICompatibleAdapter]] = {
    VllmAdapter.kind: VllmAdapter,
    SglangAdapter.kind: SglangAdapter,
    OpenAICompatibleAdapter.kind: OpenAICompatibleAdapter,
}


def adapter_for(kind: str, *, base_url: str, api_key: str = "", timeout_s: float | None = None) -> ServerAdapter:
    try:
        cls = ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"no adapter for server kind {kind!r} (known: {', '.join(ADAPTERS)})") from None
    return cls(base_url=base_url, api_key=api_key, timeout_s=timeout_s or settings.PROBE_TIMEOUT_S)


def semantics_for(kind: str) -> RequestSemantics:
    """What this server kind means by a request's length fields (vLLM's when the kind is unknown)."""
    cls = ADAPTERS.get(kind)
    return cls.semantics if cls is not None else VllmAdapter.semantics


def wire_for(kind: str) -> ServerWire:
    """This server kind's request-time wire format (the generic OpenAI one, which refuses most, when unknown)."""
    cls = ADAPTERS.get(kind, OpenAICompatibleAdapter)
    return cls.wire


def get_adapter(endpoint: Endpoint) -> ServerAdapter:
    """The adapter for an endpoint's server kind, carrying its base URL and decrypted API key."""
    return adapter_for(endpoint.kind, base_url=endpoint.base_url, api_key=endpoint.api_key)


__all__ = [
    "ADAPTERS",
    "CANARY_TEXT",
    "Continued",
    "FailureKind",
    "OpenAICompatibleAdapter",
    "PositionScores",
    "REFERENCE_TOP_N",
    "ProbeError",
    "ProbeReport",
    "Scored",
    "ServerAdapter",
    "ServerWire",
    "SglangAdapter",
    "TokenIdsSeen",
    "TokenLogprob",
    "Unsupported",
    "VllmAdapter",
    "WireError",
    "WireRequest",
    "adapter_for",
    "fingerprint",
    "get_adapter",
    "semantics_for",
    "wire_for",
]
