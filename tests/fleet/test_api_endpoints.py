"""REST API /api/v1/: endpoints CRUD, probes, 400s with field messages, and a write-only API key."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.permissions import OPERATOR, grant_role

pytestmark = pytest.mark.django_db

SECRET = "sk-live-0123456789abcdef"
ENDPOINTS = "/api/v1/endpoints/"


@pytest.fixture
def user():
    # An operator: registers endpoints and changes the ones it owns (roles: tests/fleet/test_roles.py).
    user = get_user_model().objects.create_user(username="ops", password="pw-ops-123456")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def _create(api: APIClient, **overrides):
    body = {"name": "llama", "base_url": "http://127.0.0.1:8000", "kind": "vllm", "node_class": "cpu"}
    body.update(overrides)
    return api.post(ENDPOINTS, body, format="json")


def test_it_requires_authentication():
    response = APIClient().get(ENDPOINTS)

    assert response.status_code == 401


def test_it_registers_an_endpoint_and_queues_a_probe(api):
    response = _create(api, api_key=SECRET)

    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "llama"
    assert body["has_api_key"] is True
    assert body["api_key_masked"].startswith("•")
    assert "api_key" not in body
    assert SECRET not in response.content.decode()
    assert Probe.objects.filter(endpoint_id=body["id"], status=ProbeStatus.QUEUED).count() == 1


def test_it_lists_and_retrieves_endpoints_without_the_key(api):
    created = _create(api, api_key=SECRET).json()
    _create(api, name="other", base_url="http://10.0.0.5:8000", kind="sglang")

    listing = api.get(ENDPOINTS)
    one = api.get(f"{ENDPOINTS}{created['id']}/")
    filtered = api.get(ENDPOINTS, {"kind": "sglang"})

    assert listing.status_code == 200
    assert [e["name"] for e in listing.json()["results"]] == ["llama", "other"]
    assert one.json()["base_url"] == "http://127.0.0.1:8000"
    assert [e["name"] for e in filtered.json()["results"]] == ["other"]
    for response in (listing, one, filtered):
        assert SECRET not in response.content.decode()


@pytest.mark.parametrize(
    ("body", "field", "fragment"),
    [
        ({"base_url": "http://169.254.169.254/"}, "base_url", "outside the allowed networks"),
        ({"base_url": "ftp://127.0.0.1/"}, "base_url", "scheme 'ftp' is not allowed"),
        ({"base_url": "http://127.0.0.1:99999"}, "base_url", "malformed URL"),
        ({"base_url": "not a url"}, "base_url", "is not allowed"),
        ({"name": "Not A Slug"}, "name", "lowercase"),
        ({"kind": "tgi"}, "kind", "not a valid choice"),
        ({"api_key": "two words"}, "api_key", "printable"),
    ],
)
def test_a_bad_field_is_a_400_naming_it_and_nothing_is_saved(api, body, field, fragment):
    response = _create(api, **body)

    assert response.status_code == 400
    messages = response.json()[field]
    assert any(fragment in m for m in messages), messages
    assert not Endpoint.objects.exists()
    assert not Probe.objects.exists()


def test_a_duplicate_name_is_a_400(api):
    assert _create(api).status_code == 201

    response = _create(api, base_url="http://127.0.0.2:8000")

    assert response.status_code == 400
    assert "already exists" in response.json()["name"][0]
    assert Endpoint.objects.count() == 1


def test_a_missing_field_is_a_400(api):
    response = api.post(ENDPOINTS, {"name": "llama"}, format="json")

    assert response.status_code == 400
    assert "base_url" in response.json()


def test_put_replaces_and_patch_changes_some_fields(api):
    created = _create(api, api_key=SECRET).json()
    url = f"{ENDPOINTS}{created['id']}/"

    # a new base URL needs the key again (tests/fleet/test_endpoint_key_follows_url.py)
    replacement = {"name": "llama-2", "base_url": "http://127.0.0.1:8001", "kind": "openai", "api_key": SECRET}
    put = api.put(url, replacement, format="json")
    patch = api.patch(url, {"node_class": "a100"}, format="json")

    assert put.status_code == 200, put.content
    assert patch.status_code == 200, patch.content
    body = patch.json()
    assert (body["name"], body["base_url"], body["kind"], body["node_class"]) == (
        "llama-2",
        "http://127.0.0.1:8001",
        "openai",
        "a100",
    )
    assert body["has_api_key"] is True  # not sent means kept
    assert SECRET not in put.content.decode() + patch.content.decode()


def test_patch_can_clear_the_key(api):
    created = _create(api, api_key=SECRET).json()

    response = api.patch(f"{ENDPOINTS}{created['id']}/", {"clear_api_key": True}, format="json")

    assert response.json()["has_api_key"] is False
    assert not Endpoint.objects.get(pk=created["id"]).has_api_key


def test_a_refused_patch_is_a_400_and_changes_nothing(api):
    created = _create(api).json()

    response = api.patch(f"{ENDPOINTS}{created['id']}/", {"base_url": "http://169.254.169.254"}, format="json")

    assert response.status_code == 400
    assert "base_url" in response.json()
    assert Endpoint.objects.get(pk=created["id"]).base_url == "http://127.0.0.1:8000"


def test_delete_removes_the_endpoint(api):
    created = _create(api).json()

    response = api.delete(f"{ENDPOINTS}{created['id']}/")

    assert response.status_code == 204
    assert api.get(f"{ENDPOINTS}{created['id']}/").status_code == 404
    assert not Probe.objects.exists()


def test_probe_action_queues_a_probe_and_probes_lists_them(api):
    created = _create(api).json()

    queued = api.post(f"{ENDPOINTS}{created['id']}/probe/")
    history = api.get(f"{ENDPOINTS}{created['id']}/probes/")

    assert queued.status_code == 202
    assert queued.json()["status"] == "queued"
    assert history.status_code == 200
    assert history.json()["count"] == 2
    assert history.json()["results"][0]["id"] == queued.json()["id"]  # newest first


def test_probes_list_shows_failures_with_their_reason_and_filters_by_endpoint(api, user):
    a = Endpoint.objects.create(name="a", base_url="http://127.0.0.1:1", status=EndpointStatus.UNREACHABLE, owner=user)
    b = Endpoint.objects.create(name="b", base_url="http://127.0.0.1:2", owner=user)
    Probe.objects.create(
        endpoint=a, status=ProbeStatus.DONE, outcome=EndpointStatus.UNREACHABLE, reason="connection refused"
    )
    Probe.objects.create(endpoint=b, status=ProbeStatus.QUEUED)

    every = api.get("/api/v1/probes/")
    only_a = api.get("/api/v1/probes/", {"endpoint": a.pk})
    bad = api.get("/api/v1/probes/", {"endpoint": "x"})

    assert every.json()["count"] == 2
    assert [(p["endpoint_name"], p["outcome"], p["reason"]) for p in only_a.json()["results"]] == [
        ("a", "unreachable", "connection refused")
    ]
    assert bad.status_code == 400


def test_session_auth_works_and_enforces_csrf(user):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user)

    assert client.get(ENDPOINTS).status_code == 200
    response = client.post(ENDPOINTS, {"name": "x", "base_url": "http://127.0.0.1:8000"}, format="json")
    assert response.status_code == 403
    assert "CSRF" in response.json()["detail"]


def test_the_openapi_schema_documents_the_endpoints_and_hides_the_key(api):
    response = api.get("/api/schema/", {"format": "json"})

    assert response.status_code == 200
    schema = response.json()
    assert {"/api/v1/endpoints/", "/api/v1/endpoints/{id}/probe/", "/api/v1/probes/"} <= set(schema["paths"])
    components = schema["components"]["schemas"]
    assert "api_key" not in components["Endpoint"]["properties"]
    assert components["EndpointInput"]["properties"]["api_key"]["writeOnly"] is True


def test_the_docs_page_serves_swagger_ui_from_local_static_files(api, user, client):
    client.force_login(user)

    response = client.get("/api/docs/")

    html = response.content.decode()
    assert response.status_code == 200
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in html
    assert "cdn" not in html.lower()


def test_the_openapi_schema_is_valid_and_generates_without_warnings(tmp_path):
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))

    assert "EndpointStatusEnum" in (tmp_path / "schema.yaml").read_text()
