"""Routing by served model id considers only the endpoints the caller may call, its own first: one tenant's
registration never takes another's model id down.

Why: were a model id resolved over every endpoint, any tenant registering a server that also serves
`ace-demo-target` would make the admin's `model=ace-demo-target` ambiguous (404), and the conflict message would
name the other tenant's endpoint.
"""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient
from rest_framework.authtoken.models import Token

from fleet import services
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.permissions import ADMIN, OPERATOR
from fleet.probing import run_probe
from speculation.gateway import auth, routes
from tests.support.users import api_as, make_user

pytestmark = pytest.mark.django_db

BODY = {"prompt": "def f():", "max_tokens": 4, "temperature": 0}
COMPLETION = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " pass"}]}
MODEL = "ace-demo-target"


@pytest.fixture(autouse=True)
def fresh_route_tables(redis_server):
    routes._caches.clear()
    auth.forget_all()
    yield
    routes._caches.clear()
    auth.forget_all()


@pytest.fixture
def upstream(http_stub):
    return http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})


def _endpoint(name: str, base_url: str, owner, served_model: str = MODEL, **kwargs) -> Endpoint:
    return Endpoint.objects.create(
        name=name, base_url=base_url, kind="openai", status=EndpointStatus.READY, served_model=served_model,
        owner=owner, **kwargs,
    )  # fmt: skip


def _call(user, model: str):
    key = Token.objects.get_or_create(user=user)[0].key
    return async_to_sync(AsyncClient().post)(
        "/v1/completions", {**BODY, "model": model}, content_type="application/json",
        headers={"Authorization": f"Bearer {key}"},
    )  # fmt: skip


def test_another_teams_server_with_the_same_model_id_leaves_the_admins_routing_alone(upstream, http_stub):
    # given the admin's demo serving ace-demo-target, and bob's server of another team serving the same id
    admin = make_user("boss", ADMIN)
    bob = make_user("bob", OPERATOR, teams=("research",))
    bobs_server = http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})
    demo = _endpoint("demo", upstream.base_url, admin)
    _endpoint("bobs-copy", bobs_server.base_url, bob)

    # when each calls the model id
    admins = _call(admin, MODEL)
    bobs = _call(bob, MODEL)

    # then each reaches its own server
    assert (admins.status_code, bobs.status_code) == (200, 200)
    assert len(upstream.requests) == 1 and len(bobs_server.requests) == 1
    assert routes.resolve(routes._build_table(), MODEL, auth._load(Token.objects.get(user=admin).key)).name == demo.name


def test_an_endpoint_named_like_another_tenants_model_id_leaves_its_routing_alone(upstream, http_stub):
    admin = make_user("boss", ADMIN)
    bob = make_user("bob", OPERATOR)
    _endpoint("demo", upstream.base_url, admin)
    bobs_server = http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})
    _endpoint(MODEL, bobs_server.base_url, bob, served_model="bobs-model")

    assert _call(admin, MODEL).status_code == 200
    assert _call(bob, MODEL).status_code == 200
    assert len(upstream.requests) == 1 and len(bobs_server.requests) == 1


def test_a_conflict_inside_a_team_routes_the_id_to_neither_and_only_for_that_team(upstream):
    # given two endpoints of team ml serving the same id, and the admin's demo serving it too
    admin = make_user("boss", ADMIN)
    alice = make_user("alice", OPERATOR, teams=("ml",))
    from django.contrib.auth.models import Group

    ml = Group.objects.get(name="ml")
    _endpoint("one", upstream.base_url, alice, team=ml)
    _endpoint("two", upstream.base_url, alice, team=ml)
    _endpoint("demo", upstream.base_url, admin)

    # then the id is ambiguous for ml, not for the admin; names still route
    assert _call(alice, MODEL).status_code == 404
    assert _call(alice, "one").status_code == 200
    assert _call(admin, MODEL).status_code == 200


def test_the_probe_conflict_and_the_name_check_name_no_endpoint_of_another_tenant(http_stub):
    # given the admin's demo serving ace-demo-target
    admin = make_user("boss", ADMIN)
    bob = make_user("bob", OPERATOR)
    _endpoint("demo", "http://127.0.0.1:9", admin)
    server = http_stub({("GET", "/v1/models"): lambda request: {"object": "list", "data": [{"id": MODEL}]}})

    # when bob registers a server serving the same id, and a second one in his own namespace
    twin = services.create_endpoint(name="twin", base_url=server.base_url, kind="openai", created_by=bob)
    run_probe(Probe.objects.get(endpoint=twin, status=ProbeStatus.QUEUED).pk)
    twin2 = services.create_endpoint(name="twin2", base_url=server.base_url, kind="openai", created_by=bob)
    run_probe(Probe.objects.get(endpoint=twin2, status=ProbeStatus.QUEUED).pk)
    named = api_as(bob).post(
        "/api/v1/endpoints/", {"name": MODEL, "base_url": "http://127.0.0.1:8000", "kind": "openai"}, format="json"
    )

    # then the admin's endpoint is named nowhere; bob's own conflict is reported
    twin.refresh_from_db()
    twin2.refresh_from_db()
    for text in (twin2.status_reason, str(Probe.objects.filter(endpoint=twin2).first().errors), named.content.decode()):
        assert "'demo'" not in text, text
    assert "routing problem" not in twin.status_reason or "twin2" in twin.status_reason
    assert "routing problem" in twin2.status_reason and "'twin'" in twin2.status_reason
    assert named.status_code == 400 and "'twin'" in named.json()["name"][0]
