"""Failed sign-ins and bad API tokens are throttled: past the limit within the window, a 429 with the wait."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from rest_framework.authtoken.models import Token

from ace.throttle import FailureThrottle

pytestmark = pytest.mark.django_db

PASSWORD = "pw-for-tests-only"


@pytest.fixture
def limits(settings):
    settings.LOGIN_THROTTLE = 3
    settings.TOKEN_THROTTLE = 3
    settings.THROTTLE_WINDOW_S = 60
    return settings


@pytest.fixture
def alice():
    return get_user_model().objects.create_user("alice", password=PASSWORD)


def _login(client, password: str, username: str = "alice", address: str = "10.0.0.1"):
    return client.post(reverse("login"), {"username": username, "password": password}, REMOTE_ADDR=address)


def test_it_answers_the_login_form_with_a_429_after_the_failures_allowed(client, limits, alice):
    answers = [_login(client, "wrong").status_code for _ in range(3)]
    assert answers == [200, 200, 200]
    blocked = _login(client, PASSWORD)  # even the right password: a right guess reads like a wrong one
    assert blocked.status_code == 429
    assert "try again in" in blocked.content.decode()
    assert int(blocked["Retry-After"]) > 0
    assert "_auth_user_id" not in client.session


def test_it_counts_per_username_and_address(client, limits, alice):
    for _ in range(3):
        _login(client, "wrong")
    assert _login(client, PASSWORD, address="10.0.0.2").status_code == 302  # another address
    get_user_model().objects.create_user("bob", password=PASSWORD)
    client.logout()
    assert _login(client, PASSWORD, username="bob").status_code == 302  # another username


def test_a_successful_login_clears_the_count(client, limits, alice):
    for _ in range(2):
        _login(client, "wrong")
    assert _login(client, PASSWORD).status_code == 302
    client.logout()
    for _ in range(2):
        _login(client, "wrong")
    assert _login(client, PASSWORD).status_code == 302


def test_a_limit_of_0_turns_it_off(client, limits, alice):
    limits.LOGIN_THROTTLE = 0
    assert {_login(client, "wrong").status_code for _ in range(10)} == {200}


def _rest(client, token: str, address: str = "10.0.0.9"):
    return client.get("/api/v1/endpoints/", HTTP_AUTHORIZATION=f"Token {token}", REMOTE_ADDR=address)


def test_rest_answers_bad_tokens_with_a_429_after_the_failures_allowed(client, limits, alice):
    good = Token.objects.create(user=alice).key
    assert [_rest(client, "x" * 40).status_code for _ in range(3)] == [401, 401, 401]
    blocked = _rest(client, good)
    assert blocked.status_code == 429 and int(blocked["Retry-After"]) > 0
    assert "try again in" in blocked.json()["detail"]
    assert _rest(client, good, address="10.0.0.10").status_code == 200  # another client is not affected


def _gateway(client, token: str, path: str = "/v1/completions", address: str = "10.0.0.7"):
    body = '{"model": "m", "prompt": "x"}'
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}", "REMOTE_ADDR": address}
    if path == "/v1/models":
        return client.get(path, **headers)
    return client.post(path, data=body, content_type="application/json", **headers)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
def test_the_gateway_answers_bad_tokens_with_an_openai_429_after_the_failures_allowed(client, limits, path):
    assert [_gateway(client, "bad", path).status_code for _ in range(3)] == [401, 401, 401]
    blocked = _gateway(client, "bad", path)
    assert blocked.status_code == 429 and int(blocked["Retry-After"]) > 0
    error = blocked.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "try again in" in error["message"]


def test_the_gateway_does_not_count_requests_without_a_token(client, limits):
    assert {_gateway(client, "").status_code for _ in range(6)} == {401}


def test_the_throttle_forgets_failures_older_than_the_window():
    now = [0.0]
    throttle = FailureThrottle(limit=lambda: 2, window_s=lambda: 10, clock=lambda: now[0])
    throttle.failed("k")
    throttle.failed("k")
    assert throttle.wait_s("k") == 10
    now[0] = 5.5
    assert throttle.wait_s("k") == 5
    now[0] = 10.0
    assert throttle.wait_s("k") == 0
