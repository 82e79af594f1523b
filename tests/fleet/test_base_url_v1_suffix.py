"""A base URL ending in /v1 is normalised (ACE adds /v1/... itself), and the answer says so.

Why: saved as given, every probe would fail with 404 (ACE would ask for /v1/v1/models).
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet import services
from fleet.models import Endpoint
from fleet.permissions import OPERATOR, grant_role

pytestmark = pytest.mark.django_db


@pytest.fixture
def user():
    user = get_user_model().objects.create_user(username="ops", password="pw-for-tests-only")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.mark.parametrize(
    ("given", "saved"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("http://10.0.0.5/llm/V1", "http://10.0.0.5/llm"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v10", "http://127.0.0.1:8000/v10"),
    ],
)
def test_it_normalises_a_trailing_v1(given, saved):
    assert services.normalise_base_url(given)[0] == saved


def test_registering_with_v1_saves_the_root_and_says_so(api):
    # when
    response = api.post("/api/v1/endpoints/", {"name": "llama", "base_url": "http://127.0.0.1:8000/v1"}, format="json")

    # then
    assert response.status_code == 201, response.content
    assert response.json()["base_url"] == "http://127.0.0.1:8000"
    assert "/v1 was removed" in response.json()["notices"][0]
    assert Endpoint.objects.get(name="llama").base_url == "http://127.0.0.1:8000"


def test_a_url_without_v1_has_no_notice(api):
    response = api.post("/api/v1/endpoints/", {"name": "llama", "base_url": "http://127.0.0.1:8000"}, format="json")

    assert response.json()["notices"] == []


def test_the_edit_page_says_so_too(user):
    # given
    endpoint = services.create_endpoint(name="llama", base_url="http://127.0.0.1:8000", created_by=user)
    browser = Client()
    browser.force_login(user)
    form = {"name": "llama", "base_url": "http://127.0.0.1:8001/v1/", "kind": "vllm", "node_class": "cpu"}

    # when
    response = browser.post(f"/fleet/{endpoint.pk}/edit/", form, follow=True)

    # then
    endpoint.refresh_from_db()
    assert endpoint.base_url == "http://127.0.0.1:8001"
    assert "/v1 was removed" in response.content.decode()
