"""A stored endpoint key never goes to a new URL: changing the base URL needs the key again, or drops it.

The attack it closes: PATCH base_url to a server you control; the re-probe would send the stored key there in
the Authorization header.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet import services
from fleet.models import Endpoint, Probe, ProbeStatus
from fleet.permissions import OPERATOR, grant_role
from fleet.probing import run_probe

pytestmark = pytest.mark.django_db

SECRET = "sk-live-victim-0123456789"
NEW_KEY = "sk-live-new-server-987654"


@pytest.fixture
def owner():
    user = get_user_model().objects.create_user(username="owner", password="pw-for-tests-only")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def api(owner) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=owner).key}")
    return client


@pytest.fixture
def endpoint(owner) -> Endpoint:
    endpoint = services.create_endpoint(
        name="victim", base_url="http://127.0.0.1:9", kind="openai", api_key=SECRET, created_by=owner
    )
    Probe.objects.filter(endpoint=endpoint).update(status=ProbeStatus.DONE)
    return endpoint


@pytest.fixture
def listener(http_stub):
    """A loopback server standing in for the attacker's: it records every request and its headers."""
    return http_stub({("GET", "/v1/models"): lambda request: {"object": "list", "data": [{"id": "m"}]}})


def _probe_now(endpoint: Endpoint) -> None:
    """What the worker does with the probe the change queued, run here in-process."""
    probe = Probe.objects.filter(endpoint=endpoint, status=ProbeStatus.QUEUED).latest("created_at")
    run_probe(probe.pk)


def _authorizations(listener) -> list[str]:
    return [r.headers.get("authorization", "") for r in listener.requests]


def test_it_refuses_moving_the_url_while_keeping_the_stored_key(api, endpoint, listener):
    # given an endpoint with a stored key, and a server listening elsewhere
    # when its base URL is pointed at that server without the key
    response = api.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"base_url": listener.base_url}, format="json")

    # then the change is refused, saying why, and nothing reaches the new server
    assert response.status_code == 400
    assert "API key" in response.json()["api_key"][0]
    endpoint.refresh_from_db()
    assert endpoint.base_url == "http://127.0.0.1:9"
    assert endpoint.api_key == SECRET
    assert not Probe.objects.filter(endpoint=endpoint, status=ProbeStatus.QUEUED).exists()
    assert listener.requests == []


def test_moving_the_url_and_clearing_the_key_sends_no_key(api, endpoint, listener):
    # when the URL moves with clear_api_key
    response = api.patch(
        f"/api/v1/endpoints/{endpoint.pk}/", {"base_url": listener.base_url, "clear_api_key": True}, format="json"
    )
    _probe_now(endpoint)

    # then the new server is probed without any Authorization header
    assert response.status_code == 200, response.content
    assert response.json()["has_api_key"] is False
    assert listener.requests, "the re-probe reached the new URL"
    assert all(SECRET not in header for header in _authorizations(listener))
    assert _authorizations(listener) == [""] * len(listener.requests)


def test_moving_the_url_with_a_new_key_sends_only_the_new_key(api, endpoint, listener):
    # when the URL moves with the new server's key
    response = api.patch(
        f"/api/v1/endpoints/{endpoint.pk}/", {"base_url": listener.base_url, "api_key": NEW_KEY}, format="json"
    )
    _probe_now(endpoint)

    # then only the new key reaches the new server
    assert response.status_code == 200, response.content
    assert listener.requests
    assert set(_authorizations(listener)) == {f"Bearer {NEW_KEY}"}


def test_the_edit_page_asks_for_the_key_again_when_the_url_changes(owner, endpoint, listener):
    # given the operator on the edit form, leaving the key blank ("keep it")
    browser = Client()
    browser.force_login(owner)
    form = {"name": "victim", "base_url": listener.base_url, "kind": "openai", "node_class": "cpu", "api_key": ""}

    # when
    response = browser.post(f"/fleet/{endpoint.pk}/edit/", form)

    # then the form answers with the reason and the endpoint is unchanged
    assert response.status_code == 200
    assert "enter the API key again" in response.content.decode()
    endpoint.refresh_from_db()
    assert endpoint.base_url == "http://127.0.0.1:9"
    assert listener.requests == []


def test_changing_other_fields_keeps_the_key(api, endpoint):
    # when only the node class changes
    response = api.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"node_class": "a100"}, format="json")

    # then
    assert response.status_code == 200
    endpoint.refresh_from_db()
    assert endpoint.api_key == SECRET
