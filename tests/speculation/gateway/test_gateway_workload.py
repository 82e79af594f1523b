"""Every stage record carries its request's workload key; a bad key is a 400 naming where it came from.

Requests run through `ace.asgi.application` (httpx's ASGI transport) inside async_to_sync, so the gateway's
database reads and its background record writes see the test's transaction; the test waits for those writes.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token

from fleet.models import Endpoint, EndpointStatus
from speculation.gateway import background, routes
from speculation.models import Mode, SpeculationPolicy, StageRecord
from speculation.services.version import bump_routing_version

pytestmark = pytest.mark.django_db(transaction=True)

COMPLETION = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " pass"}]}
COMPLETION["usage"] = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


@pytest.fixture
def endpoint_in(redis_server, http_stub):
    upstream = http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})
    routes._caches.clear()

    def make(mode: str) -> tuple[str, str]:
        user = get_user_model().objects.create_superuser(f"wl-{mode}", password="pw-for-tests-only")
        endpoint = Endpoint.objects.create(
            name=f"wl-{mode}", base_url=upstream.base_url, kind="openai", status=EndpointStatus.READY
        )
        # prod with no verification path that fits (nothing probed): answered plainly, recorded as skipped
        SpeculationPolicy.objects.create(endpoint=endpoint, mode=mode, path="remote")
        bump_routing_version()
        return endpoint.name, Token.objects.create(user=user).key

    yield make
    routes._caches.clear()


def _post(model: str, token: str, body: dict, headers: dict | None = None) -> httpx.Response:
    from ace.asgi import application

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.post(
                "/v1/completions",
                content=json.dumps({"model": model, "max_tokens": 1, "temperature": 0, **body}).encode(),
                headers={"Authorization": f"Bearer {token}", **(headers or {})},
            )
        await asyncio.gather(*list(background._pending), return_exceptions=True)  # the record writes
        return response

    return async_to_sync(go)()


def test_the_header_then_metadata_then_user_then_the_prompts_category_is_recorded(endpoint_in):
    # given: a prod endpoint whose requests are all answered plainly (and recorded)
    model, token = endpoint_in(Mode.PROD)
    # when
    sent = [
        ({"prompt": "Who played anna in once upon a time?", "user": "u1"}, {"X-ACE-Workload": "team-a/search"}),
        ({"prompt": "Who played anna?", "user": "u1", "metadata": {"workload": "faq"}}, None),
        ({"prompt": "Who played anna?", "user": "alice@example.com"}, None),
        ({"prompt": "def fibonacci(n):"}, None),
        ({"prompt": "Translate German to English: Der Hund schläft ."}, None),
    ]
    for body, headers in sent:
        assert _post(model, token, body, headers).status_code == 200
    # then
    recorded = list(StageRecord.objects.order_by("id").values_list("workload", flat=True))
    assert recorded == ["team-a/search", "faq", "alice@example.com", "code", "translation"]


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({}, {"X-ACE-Workload": "x" * 10_000}, "X-ACE-Workload header"),
        ({}, {"X-ACE-Workload": "code\x01"}, "X-ACE-Workload header"),
        ({"metadata": {"workload": "a\tb"}}, None, "metadata.workload"),
        ({"user": "u" * 65}, None, "user"),
    ],
    ids=["10kB-header", "control-char-header", "tab-in-metadata", "long-user"],
)
def test_a_bad_workload_key_is_an_openai_400_and_nothing_is_stored(endpoint_in, body, headers, param):
    model, token = endpoint_in(Mode.SHADOW)
    response = _post(model, token, {"prompt": "def f():", **body}, headers)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_workload"
    assert param in error["message"] and "xxxxxxxxxx" not in error["message"]
    assert not StageRecord.objects.exists()


def test_off_mode_does_not_read_the_workload(endpoint_in):
    model, token = endpoint_in(Mode.OFF)
    assert _post(model, token, {"prompt": "def f():"}, {"X-ACE-Workload": "x" * 10_000}).status_code == 200
    assert not StageRecord.objects.exists()
