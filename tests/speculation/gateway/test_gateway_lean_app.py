"""The lean /v1 app (speculation.gateway.asgi, mounted by ace.asgi): the same checks as the Django views, with
tokens and routes cached per process and invalidated by the gateway version.

Requests run through `ace.asgi.application` itself (httpx's ASGI transport), inside async_to_sync so that the
gateway's database reads see the test's transaction. Tests of invalidation run with Redis up: without it cached
entries live 0.25 s only, and a slow test would pass without any invalidation.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import connections
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token

from fleet.models import Endpoint, EndpointStatus, GatewayTokenScope
from fleet.permissions import ADMIN, OPERATOR, VIEWER, grant_role
from speculation.gateway import freshness
from speculation.gateway.errors import REQUEST_ID_HEADER

pytestmark = pytest.mark.django_db

BODY = {"prompt": "def f():", "max_tokens": 4, "temperature": 0}
COMPLETION = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": " pass"}]}


@pytest.fixture(autouse=True)
def _fresh(fresh_caches):
    """Every test here starts with empty route and token caches."""


@pytest.fixture
def upstream(http_stub):
    return http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})


def _user(name: str, role: str, *, teams: tuple[str, ...] = ()):
    user = get_user_model().objects.create_user(username=name, password="pw-for-tests-only")
    grant_role(user=user, role=role)
    for team in teams:
        user.groups.add(Group.objects.get_or_create(name=team)[0])
    return user


def _endpoint(name: str, base_url: str, **kwargs) -> Endpoint:
    return Endpoint.objects.create(name=name, base_url=base_url, kind="openai", status=EndpointStatus.READY, **kwargs)


def _in_one_loop(*requests: dict) -> list[tuple[httpx.Response, int]]:
    """Each request (method, path, token, body, headers) through ace.asgi.application, all in one event loop as in
    a web process, with the number of database queries it made."""
    from ace.asgi import application

    async def go(queries: CaptureQueriesContext) -> list[tuple[httpx.Response, int]]:
        out = []
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            for request in requests:
                token, body = request.get("token", ""), request.get("body")
                headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **request.get("headers", {})}
                content = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
                before = len(queries.captured_queries)
                response = await client.request(
                    request.get("method", "POST"), request["path"], content=content, headers=headers
                )
                out.append((response, len(queries.captured_queries) - before))
        return out

    # this thread's connection itself (the proxy would name the event loop's thread's): the reads run here
    with CaptureQueriesContext(connections["default"]) as queries:
        return async_to_sync(go)(queries)


def _request(method: str, path: str, *, token: str = "", body=None, headers: dict | None = None) -> httpx.Response:
    request = {"method": method, "path": path, "token": token, "body": body, "headers": headers or {}}
    return _in_one_loop(request)[0][0]


def _complete(token: str, model: str) -> httpx.Response:
    return _request("POST", "/v1/completions", token=token, body={**BODY, "model": model})


def test_v1_is_served_by_the_lean_app_and_everything_else_by_django(upstream):
    # given an admin's token and an endpoint
    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key

    # when a completion goes through ACE's ASGI application
    response = _complete(key, "demo")

    # then the server's answer comes back with the request id and the security headers Django's middleware set
    assert response.status_code == 200
    assert response.json() == COMPLETION
    assert response.headers[REQUEST_ID_HEADER]
    assert response.headers["X-Content-Type-Options"] == "nosniff"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert "sessionid" not in response.headers.get("set-cookie", "")
    # and a page still goes through Django (its login redirect)
    page = _request("GET", "/fleet/")
    assert page.status_code == 302 and "/login/" in page.headers["location"]


def test_a_cached_token_and_route_cost_no_database_query(upstream, redis_server):
    # given an operator's token (its callable endpoints are a query of their own)
    admin = _user("boss", OPERATOR)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    request = {"path": "/v1/completions", "token": key, "body": {**BODY, "model": "demo"}}

    # when it calls three times in one web process
    (first, first_queries), *rest = _in_one_loop(request, request, request)

    # then the first request reads the token and the routing table, the others nothing
    assert first.status_code == 200 and first_queries > 0
    assert [(r.status_code, queries) for r, queries in rest] == [(200, 0), (200, 0)]


def test_a_revoked_token_is_refused_on_the_next_request(upstream, redis_server):
    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    assert _complete(key, "demo").status_code == 200

    Token.objects.filter(key=key).delete()  # ace_token --rotate, the admin

    response = _complete(key, "demo")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_another_teams_endpoint_reads_as_unknown_and_a_role_change_applies_at_once(upstream, redis_server):
    # given alice in team ml, bob's endpoint shared with ml, and bob's private one
    alice = _user("alice", OPERATOR, teams=("ml",))
    bob = _user("bob", OPERATOR)
    _endpoint("team-ep", upstream.base_url, owner=bob, team=Group.objects.get(name="ml"))
    _endpoint("bob-ep", upstream.base_url, owner=bob)
    key = Token.objects.create(user=alice).key

    # then her token calls the team's endpoint, and bob's private one answers as an unknown model
    assert _complete(key, "team-ep").status_code == 200
    other = _complete(key, "bob-ep")
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"

    # when she leaves the team, the next request is refused too
    alice.groups.remove(Group.objects.get(name="ml"))
    assert _complete(key, "team-ep").status_code == 404

    # and when she is made admin, she sees bob's endpoint on the next request
    grant_role(user=alice, role=ADMIN)
    assert _complete(key, "bob-ep").status_code == 200


def test_narrowing_a_tokens_scope_applies_on_the_next_request(upstream, redis_server):
    admin = _user("boss", ADMIN)
    demo = _endpoint("demo", upstream.base_url)
    _endpoint("other", upstream.base_url)
    key = Token.objects.create(user=admin).key
    assert _complete(key, "other").status_code == 200

    scope = GatewayTokenScope.objects.create(token_id=key, all_visible=False)
    scope.endpoints.add(demo)

    assert _complete(key, "other").status_code == 404
    assert _complete(key, "demo").status_code == 200


def test_a_change_no_signal_announces_applies_after_the_ttl(upstream, redis_server, settings, monkeypatch):
    # given a served token, remembered for GATEWAY_AUTH_TTL_S
    settings.GATEWAY_AUTH_TTL_S = 60.0
    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    assert _complete(key, "demo").status_code == 200

    # when its user is deactivated by a queryset update (no signal, no version bump)
    get_user_model().objects.filter(pk=admin.pk).update(is_active=False)

    # then within the TTL the remembered answer stands (the documented bound) ...
    assert _complete(key, "demo").status_code == 200
    # ... and once the TTL has passed the token is refused
    later = freshness.time.monotonic() + 61.0
    monkeypatch.setattr(freshness.time, "monotonic", lambda: later)
    assert _complete(key, "demo").status_code == 401


def test_a_version_bump_from_another_process_drops_the_cached_token(upstream, redis_server):
    import redis

    from speculation.services.version import ROUTING_VERSION_KEY

    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    assert _complete(key, "demo").status_code == 200
    get_user_model().objects.filter(pk=admin.pk).update(is_active=False)

    # another process (the admin's web worker, ace_token) bumps the version in Redis after its change
    redis.Redis.from_url(redis_server.url).incr(ROUTING_VERSION_KEY)

    assert _complete(key, "demo").status_code == 401


@pytest.mark.parametrize(
    ("method", "path", "headers", "body", "status"),
    [
        ("POST", "/v1/completions", {}, {"model": "demo"}, 401),
        ("GET", "/v1/completions", {"auth": True}, None, 405),
        ("POST", "/v1/completions", {"auth": True}, b"{", 400),
        ("POST", "/v1/completions", {"auth": True, "Host": "evil.example"}, {"model": "demo"}, 400),
        ("POST", "/v1/completions", {"auth": True}, {"model": "demo", "prompt": "x" * 40_000}, 413),
    ],
    ids=["no-token", "get", "not-json", "bad-host", "too-large"],
)
def test_bad_requests_get_openai_shaped_errors(upstream, settings, method, path, headers, body, status):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 32_768
    admin = _user("boss", ADMIN)
    _endpoint("demo", upstream.base_url, owner=admin)
    key = Token.objects.create(user=admin).key
    extra = {k: v for k, v in headers.items() if k != "auth"}
    response = _request(method, path, token=key if headers.get("auth") else "", body=body, headers=extra)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["message"]
    assert len(upstream.requests) == 0


def test_models_lists_only_what_the_token_may_call(upstream):
    alice = _user("alice", VIEWER)
    bob = _user("bob", OPERATOR)
    _endpoint("alice-ep", upstream.base_url, owner=alice)
    _endpoint("bob-ep", upstream.base_url, owner=bob)
    key = Token.objects.create(user=alice).key

    listed = _request("GET", "/v1/models", token=key).json()["data"]

    assert [m["id"] for m in listed] == ["alice-ep"]


def test_a_reader_that_follows_bumps_learns_of_one_without_reading_redis(redis_server, monkeypatch):
    from speculation.services.version import publish_bump

    monkeypatch.setattr(freshness, "RECHECK_S", 600.0)  # no periodic re-read during the test, however slow

    async def go() -> tuple[bytes | None, bytes | None]:
        reader = freshness.VersionReader()
        reader.follow_bumps()
        for _ in range(200):  # until the subscription is confirmed (at most 10 s)
            if reader._subscribed:
                break
            await asyncio.sleep(0.05)
        before = (await reader.stamp()).redis  # one read, right after subscribing

        def no_reads():
            raise AssertionError("the reader read Redis instead of following the bumps")

        reader._client = no_reads
        # when another process bumps the version
        await asyncio.to_thread(publish_bump)
        for _ in range(200):
            after = (await reader.stamp()).redis
            if after != before:
                break
            await asyncio.sleep(0.05)
        return before, after

    before, after = async_to_sync(go)()
    assert after is not None and int(after) == int(before) + 1


def test_a_client_that_disconnects_cancels_the_request(monkeypatch):
    # given a request whose answer takes long (prod waiting for a worker, a long plain generation)
    from speculation.gateway import asgi, views

    seen: list[str] = []

    async def slow_serve(**_: object):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")  # what prod reads as "the client went away"
            raise

    monkeypatch.setattr(views, "serve", slow_serve)
    app = asgi.GatewayApp(fallback=None)
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b"{}", "more_body": False}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        if len(messages) == 1:
            await asyncio.sleep(0.05)  # the client hangs up while the answer is being worked out
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"host", b"127.0.0.1")]}

    # when the client disconnects
    async_to_sync(app)(scope, receive, send)

    # then the request's work was cancelled and nothing was sent
    assert seen == ["cancelled"]
    assert sent == []
