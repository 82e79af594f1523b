"""Probe failures show on the pages and in the API with their reasons (real probes, real loopback servers)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from ace.processes import free_port
from fleet import services
from fleet.models import Probe
from fleet.permissions import ADMIN, grant_role
from fleet.probing import run_probe

pytestmark = pytest.mark.django_db

SECRET = "sk-wrong-key-0123456789"


@pytest.fixture
def browser() -> Client:
    client = Client()
    user = get_user_model().objects.create_user(username="ops", password="pw-ops-123456")
    grant_role(user=user, role=ADMIN)  # sees every endpoint: these tests are about probe failures, not roles
    client.force_login(user)
    return client


def _register_and_probe(base_url: str, **kwargs):
    endpoint = services.create_endpoint(name="target", base_url=base_url, kind="openai", **kwargs)
    run_probe(Probe.objects.get(endpoint=endpoint).pk)  # what the worker does, run here in-process
    endpoint.refresh_from_db()
    return endpoint


def _status_panel(browser: Client, endpoint) -> str:
    return browser.get(reverse("fleet:endpoint-detail", args=[endpoint.pk])).content.decode()


def test_a_server_that_is_down_shows_as_unreachable_with_the_reason(browser):
    endpoint = _register_and_probe(f"http://127.0.0.1:{free_port()}")

    html = _status_panel(browser, endpoint)
    listing = browser.get(reverse("fleet:endpoint-list")).content.decode()

    assert endpoint.status == "unreachable"
    assert 'data-status="unreachable"' in html
    assert "unreachable:" in html and endpoint.status_reason.split(":", 1)[1].strip()[:20] in html
    assert 'data-pending="false"' in html  # finished: the panel stops polling
    assert "Unreachable" in listing


def test_a_refused_key_shows_as_unauthorized_and_the_key_stays_hidden(browser, http_stub):
    stub = http_stub({("GET", "/v1/models"): lambda r: (401, {"content-type": "application/json"}, b"{}")})

    endpoint = _register_and_probe(stub.base_url, api_key=SECRET)

    html = _status_panel(browser, endpoint)
    api = browser.get(f"/api/v1/endpoints/{endpoint.pk}/probes/").content.decode()
    assert endpoint.status == "unauthorized"
    assert "the server refused the API key" in html
    assert "HTTP 401" in html
    assert stub.requests[0].headers["authorization"] == f"Bearer {SECRET}"  # it was sent...
    assert SECRET not in html and SECRET not in api  # ...and never shown


def test_an_answer_that_is_not_json_is_shown_as_such(browser, http_stub):
    stub = http_stub({("GET", "/v1/models"): lambda r: (200, {"content-type": "text/html"}, b"<h1>hello</h1>")})

    endpoint = _register_and_probe(stub.base_url)

    html = _status_panel(browser, endpoint)
    assert endpoint.status == "error"
    assert "not JSON" in html
