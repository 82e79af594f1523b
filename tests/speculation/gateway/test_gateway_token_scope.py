"""Gateway tokens: each calls only the endpoints it is scoped to, and a revoked one stops on the next request.

Tokens are cached per process (speculation/gateway/auth.py), invalidated by the signals of every change made
through Django; a change no signal announces applies within ACE_GATEWAY_AUTH_TTL
(tests/speculation/gateway/test_gateway_lean_app.py).
"""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import call_command
from django.test import AsyncClient
from rest_framework.authtoken.models import Token

from fleet.models import Endpoint, EndpointStatus, GatewayTokenScope
from fleet.permissions import ADMIN, OPERATOR, grant_role
from speculation.gateway import auth, routes

pytestmark = pytest.mark.django_db

BODY = {"model": "", "prompt": "def f():", "max_tokens": 4, "temperature": 0}
COMPLETION = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " pass"}]}


@pytest.fixture(autouse=True)
def fresh_route_tables(redis_server):
    # Redis up: cached tokens then live the TTL, so "refused on the next request" needs the invalidation
    routes._caches.clear()  # one table per event loop: each request below runs in a fresh loop
    auth.forget_all()
    yield
    routes._caches.clear()
    auth.forget_all()


@pytest.fixture
def upstream(http_stub):
    return http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})


def _endpoint(name: str, base_url: str, **kwargs) -> Endpoint:
    return Endpoint.objects.create(
        name=name, base_url=base_url, kind="openai", status=EndpointStatus.READY, served_model=f"{name}-model", **kwargs
    )


def _user(name: str, role: str, *, teams: tuple[str, ...] = ()):
    user = get_user_model().objects.create_user(username=name, password="pw-for-tests-only")
    grant_role(user=user, role=role)
    for team in teams:
        user.groups.add(Group.objects.get_or_create(name=team)[0])
    return user


def _call(token: str, model: str):
    client = AsyncClient()
    return async_to_sync(client.post)(
        "/v1/completions",
        {**BODY, "model": model},
        content_type="application/json",
        headers={"Authorization": f"Bearer {token}"},
    )


def _models(token: str) -> list[str]:
    client = AsyncClient()
    response = async_to_sync(client.get)("/v1/models", headers={"Authorization": f"Bearer {token}"})
    return sorted(m["id"] for m in response.json()["data"])


def test_a_revoked_token_stops_working_on_the_next_request(upstream):
    # given a token that just worked
    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    assert _call(key, "demo").status_code == 200

    # when it is revoked (deleted, as `ace_token --rotate` and the admin do)
    Token.objects.filter(key=key).delete()

    # then the very next request is refused
    response = _call(key, "demo")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_deactivated_user_s_token_stops_at_once(upstream):
    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    assert _call(key, "demo").status_code == 200

    admin.is_active = False  # as the admin's user page saves it
    admin.save()

    assert _call(key, "demo").status_code == 401


def test_a_token_calls_only_the_endpoints_its_user_can_see(upstream):
    # given alice's endpoint and her team's, and bob's endpoint
    alice = _user("alice", OPERATOR, teams=("ml",))
    bob = _user("bob", OPERATOR)
    _endpoint("alice-ep", upstream.base_url, owner=alice)
    _endpoint("team-ep", upstream.base_url, owner=bob, team=Group.objects.get(name="ml"))
    _endpoint("bob-ep", upstream.base_url, owner=bob)
    key = Token.objects.create(user=alice).key

    # when alice's token calls bob's endpoint, by name and by served model id
    by_name = _call(key, "bob-ep")
    by_model = _call(key, "bob-ep-model")

    # then both read like an unknown model, and the listing shows only what alice can call
    assert (by_name.status_code, by_model.status_code) == (404, 404)
    assert by_name.json()["error"]["code"] == "model_not_found"
    assert _call(key, "alice-ep").status_code == 200
    assert _call(key, "team-ep").status_code == 200
    assert _models(key) == ["alice-ep", "team-ep"]
    assert len(upstream.requests) == 2


def test_a_token_scoped_to_a_listed_set_calls_only_those(upstream, capsys):
    # given an admin (sees everything) whose CI token is limited to one endpoint
    _user("admin", ADMIN)
    _endpoint("demo", upstream.base_url)
    _endpoint("prod-llama", upstream.base_url)
    call_command("ace_token", "admin", "--endpoint", "demo")
    key = capsys.readouterr().out.strip()

    # when / then
    assert _call(key, "demo").status_code == 200
    assert _call(key, "prod-llama").status_code == 404
    assert _models(key) == ["demo"]

    # and widening it again takes effect on the next request
    call_command("ace_token", "admin", "--all-endpoints")
    assert _call(key, "prod-llama").status_code == 200
    assert not GatewayTokenScope.objects.get(token_id=key).endpoints.exists()


def test_ace_token_refuses_an_unknown_endpoint_name():
    _user("admin", ADMIN)
    with pytest.raises(Exception, match="no-such"):
        call_command("ace_token", "admin", "--endpoint", "no-such")
