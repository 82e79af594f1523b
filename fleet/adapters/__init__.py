"""One client adapter per server kind, behind one protocol (`ServerAdapter`). Pick one with `get_adapter`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings

from fleet.adapters.base import CANARY_TEXT, FailureKind, ProbeError, ProbeReport, ServerAdapter, fingerprint
from fleet.adapters.openai import OpenAICompatibleAdapter
from fleet.adapters.semantics import RequestSemantics
from fleet.adapters.sglang import SglangAdapter
from fleet.adapters.vllm import VllmAdapter

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


def get_adapter(endpoint: Endpoint) -> ServerAdapter:
    """The adapter for an endpoint's server kind, carrying its base URL and decrypted API key."""
    return adapter_for(endpoint.kind, base_url=endpoint.base_url, api_key=endpoint.api_key)


__all__ = [
    "ADAPTERS",
    "CANARY_TEXT",
    "FailureKind",
    "OpenAICompatibleAdapter",
    "ProbeError",
    "ProbeReport",
    "ServerAdapter",
    "SglangAdapter",
    "VllmAdapter",
    "adapter_for",
    "fingerprint",
    "get_adapter",
    "semantics_for",
]
