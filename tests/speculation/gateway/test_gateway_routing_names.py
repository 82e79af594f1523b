"""Unambiguous routing: a model name resolves to exactly one endpoint among one owner's (and team's) endpoints.

Why: an endpoint NAMED like another endpoint's served model id (ace-demo-target) must not take that model's
traffic, prompts included, to its own URL. Across tenants: test_gateway_routing_tenants.py.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet import services
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.permissions import ADMIN, grant_role
from fleet.probing import run_probe
from speculation.gateway.auth import Principal
from speculation.gateway.routes import _build_table, resolve

pytestmark = pytest.mark.django_db

ENDPOINTS = "/api/v1/endpoints/"


@pytest.fixture
def boss():
    user = get_user_model().objects.create_user(username="boss", password="pw-for-tests-only")
    grant_role(user=user, role=ADMIN)
    return user


@pytest.fixture
def api(boss) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=boss).key}")
    return client


@pytest.fixture
def demo(boss) -> Endpoint:
    return Endpoint.objects.create(
        name="demo", base_url="http://127.0.0.1:9", status=EndpointStatus.READY, served_model="ace-demo-target",
        owner=boss,
    )  # fmt: skip


def _routed(model: str, user) -> int | None:
    """The endpoint id `model` routes to for the user's admin token."""
    route = resolve(_build_table(), model, Principal(user_id=user.pk, callable_ids=None))
    return route.endpoint_id if route is not None else None


def test_it_refuses_a_name_equal_to_another_endpoints_served_model(api, demo):
    # given demo serves ace-demo-target
    # when someone registers an endpoint named ace-demo-target at their own URL
    response = api.post(
        ENDPOINTS, {"name": "ace-demo-target", "base_url": "http://10.9.9.9:8000", "kind": "openai"}, format="json"
    )

    # then it is refused naming the endpoint it would shadow, and the model still routes to demo
    assert response.status_code == 400
    assert "'demo'" in response.json()["name"][0]
    assert not Endpoint.objects.filter(name="ace-demo-target").exists()
    assert _routed("ace-demo-target", demo.owner) == demo.pk


def test_it_refuses_a_rename_onto_another_endpoints_served_model(api, demo):
    # given a second endpoint
    other = services.create_endpoint(name="other", base_url="http://10.9.9.9:8000", created_by=demo.owner)

    # when it is renamed to demo's model id
    response = api.patch(f"{ENDPOINTS}{other.pk}/", {"name": "ace-demo-target"}, format="json")

    # then
    assert response.status_code == 400
    assert "'demo'" in response.json()["name"][0]
    other.refresh_from_db()
    assert other.name == "other"


def test_an_endpoint_may_be_named_like_its_own_served_model(demo):
    endpoint = services.create_endpoint(name="llama", base_url="http://10.0.0.5:8000", created_by=demo.owner)
    Endpoint.objects.filter(pk=endpoint.pk).update(served_model="llama")

    renamed = services.update_endpoint(endpoint=Endpoint.objects.get(pk=endpoint.pk), name="llama")

    assert renamed.name == "llama"
    assert _routed("llama", demo.owner) == endpoint.pk


def test_a_probe_finding_another_endpoints_name_as_its_model_records_a_problem_and_routes_by_name(http_stub, demo):
    # given a server whose served model id is "demo", the name of another endpoint
    server = http_stub({("GET", "/v1/models"): lambda request: {"object": "list", "data": [{"id": "demo"}]}})
    sneaky = services.create_endpoint(name="sneaky", base_url=server.base_url, kind="openai", created_by=demo.owner)

    # when it is probed
    probe = run_probe(Probe.objects.get(endpoint=sneaky, status=ProbeStatus.QUEUED).pk)

    # then the conflict is recorded on the probe and the endpoint, and "demo" still means the endpoint demo
    sneaky.refresh_from_db()
    assert sneaky.served_model == "demo"
    assert any(e["step"] == "routing" and "'demo'" in e["message"] for e in probe.errors)
    assert "routing problem" in sneaky.status_reason
    assert (_routed("demo", demo.owner), _routed("sneaky", demo.owner)) == (demo.pk, sneaky.pk)


def test_a_model_id_served_by_two_endpoints_routes_to_neither(http_stub, demo):
    # given a second server serving the same model id as demo
    server = http_stub({("GET", "/v1/models"): lambda request: {"object": "list", "data": [{"id": "ace-demo-target"}]}})
    twin = services.create_endpoint(name="twin", base_url=server.base_url, kind="openai", created_by=demo.owner)

    # when it is probed
    run_probe(Probe.objects.get(endpoint=twin, status=ProbeStatus.QUEUED).pk)

    # then the shared id names no endpoint; each stays reachable by its own name
    twin.refresh_from_db()
    assert "'demo'" in twin.status_reason
    assert _routed("ace-demo-target", demo.owner) is None
    assert (_routed("demo", demo.owner), _routed("twin", demo.owner)) == (demo.pk, twin.pk)
