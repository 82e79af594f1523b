"""A base URL holding CR, LF, TAB, a space, a broken %-escape or an invisible Unicode character is refused with a
400 on base_url (REST and the form); one already stored never makes the gateway answer 500 nor splits a log line.

Why: urlparse drops CR, LF and TAB before it parses, so a check of its result passes `http://127.0.0.1:8000/a\\r\\nb`;
httpx then refuses the stored URL (InvalidURL: a failed probe, a 500 from /v1) and the newline splits log lines.
"""

from __future__ import annotations

import json
import logging

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from rest_framework.test import APIClient

from fleet.models import Endpoint, EndpointStatus
from fleet.netpolicy import URLNotAllowed, check_url
from fleet.probing import run_probe
from speculation.gateway.errors import REQUEST_ID_HEADER
from speculation.models import Mode, SpeculationPolicy

pytestmark = pytest.mark.django_db

BASE = "http://127.0.0.1:8000"
BAD_URLS = {
    "cr-lf": BASE + "/a\r\nX-Injected: 1",
    "lf": BASE + "/a\nb",
    "tab": BASE + "/a\tb",
    "space": BASE + "/a b",
    "percent": BASE + "/a%zz",
    "percent-at-end": BASE + "/a%2",
    "rtl-override": BASE + "/\u202egnp.exe",
    "zero-width": BASE + "/a\u200bb",
    "nul": BASE + "/a\x00",
    "line-separator": BASE + "/a\u2028b",
    "host-nbsp": "http://127.0.0.1\u00a0:8000",
}


@pytest.fixture
def admin():
    return get_user_model().objects.create_superuser("url-admin", password="pw-for-tests-only")


@pytest.fixture
def api(admin) -> APIClient:
    client = APIClient()
    client.force_authenticate(admin)
    return client


@pytest.mark.parametrize("url", BAD_URLS.values(), ids=BAD_URLS.keys())
def test_the_network_policy_refuses_it_naming_the_character(url):
    with pytest.raises(URLNotAllowed, match=r"the URL holds .*at position \d+"):
        check_url(url)


def test_a_valid_escape_and_a_trailing_newline_pasted_with_it_are_still_fine():
    assert check_url(BASE + "/models%2Fllama") == BASE + "/models%2Fllama"
    assert check_url(BASE + "/\n") == BASE  # surrounding whitespace is stripped, not stored


@pytest.mark.parametrize("url", BAD_URLS.values(), ids=BAD_URLS.keys())
def test_rest_refuses_it_on_base_url_and_stores_nothing(api, url):
    response = api.post("/api/v1/endpoints/", {"name": "bad-url", "base_url": url}, format="json")
    assert response.status_code == 400, response.content
    assert response.json()["base_url"]  # "the URL holds ...", or DRF's own "Null characters are not allowed."
    assert not Endpoint.objects.exists()


def test_rest_refuses_it_on_an_update_too(api):
    endpoint = Endpoint.objects.create(name="good", base_url=BASE)
    response = api.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"base_url": BAD_URLS["cr-lf"]}, format="json")
    assert response.status_code == 400 and "base_url" in response.json()
    endpoint.refresh_from_db()
    assert endpoint.base_url == BASE


@pytest.mark.parametrize("key", ["cr-lf", "space", "percent", "rtl-override"])
def test_the_form_refuses_it_on_the_field(client, admin, key):
    client.force_login(admin)
    form = {"name": "bad-url", "base_url": BAD_URLS[key], "kind": "vllm", "node_class": "cpu"}
    response = client.post(reverse("fleet:endpoint-create"), form)
    assert response.status_code == 200
    assert "the URL holds" in " ".join(response.context["form"].errors["base_url"])
    assert not Endpoint.objects.exists()


# --- a URL stored before this check -------------------------------------------------------------------------------


def test_a_probe_of_a_stored_bad_url_says_why_without_connecting():
    endpoint = Endpoint.objects.create(name="stored", base_url=BAD_URLS["cr-lf"])
    from fleet.models import Probe

    probe = run_probe(Probe.objects.create(endpoint=endpoint).pk)
    assert "the URL holds a control character (U+000D)" in probe.reason
    assert "InvalidURL" not in probe.reason


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.SHADOW, Mode.PROD])
def test_the_gateway_answers_a_stored_bad_url_with_an_openai_502_not_a_500(client, redis_server, admin, mode):
    from rest_framework.authtoken.models import Token

    from speculation.services.version import bump_routing_version

    endpoint = Endpoint.objects.create(name="stored", base_url=BAD_URLS["cr-lf"], status=EndpointStatus.READY)
    SpeculationPolicy.objects.update_or_create(endpoint=endpoint, defaults={"mode": mode})
    bump_routing_version()
    body = json.dumps({"model": "stored", "prompt": "x", "max_tokens": 2, "temperature": 0})
    headers = {"HTTP_AUTHORIZATION": f"Bearer {Token.objects.create(user=admin).key}"}
    response = client.post("/v1/completions", data=body, content_type="application/json", **headers)
    assert response.status_code == 502
    assert response[REQUEST_ID_HEADER]
    error = response.json()["error"]
    assert error["code"] == "upstream_misconfigured" and "the URL holds" in error["message"]


def test_a_logged_value_with_a_newline_stays_on_one_line(caplog):
    logging.getLogger("fleet.probing").warning("endpoint %s: probe failed", "a\r\nFAKE 200 OK")
    record = caplog.records[-1]
    assert record.getMessage() == "endpoint a\\r\\nFAKE 200 OK: probe failed"
