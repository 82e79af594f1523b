"""One adapter per server kind, chosen by `get_adapter` from the endpoint's kind."""

from __future__ import annotations

import pytest
from django.conf import settings

from fleet.adapters import ADAPTERS, OpenAICompatibleAdapter, SglangAdapter, VllmAdapter, adapter_for, get_adapter
from fleet.models import Endpoint, ServerKind


@pytest.mark.parametrize(
    ("kind", "cls"),
    [(ServerKind.VLLM, VllmAdapter), (ServerKind.SGLANG, SglangAdapter), (ServerKind.OPENAI, OpenAICompatibleAdapter)],
)
def test_every_server_kind_has_its_adapter(kind, cls):
    endpoint = Endpoint(name="e", base_url="http://127.0.0.1:8001/", kind=kind)
    endpoint.api_key = "sk-test-key-123456"
    adapter = get_adapter(endpoint)
    assert type(adapter) is cls
    assert adapter.base_url == "http://127.0.0.1:8001"
    assert adapter.timeout_s == settings.PROBE_TIMEOUT_S
    assert "sk-test" not in repr(adapter)


def test_the_registry_covers_exactly_the_model_choices():
    assert set(ADAPTERS) == set(ServerKind.values)


def test_an_unknown_kind_is_refused_with_the_known_ones_named():
    with pytest.raises(ValueError, match="known: vllm, sglang, openai"):
        adapter_for("tgi", base_url="http://127.0.0.1:1")
