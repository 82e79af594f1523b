"""/api/v1/ lists every REST route (fleet and speculation); /api/schema/ and /api/docs/ follow
ACE_API_DOCS_PUBLIC (default: sign-in required).
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


@pytest.fixture
def user():
    return get_user_model().objects.create_user(username="viewer", password="pw-for-tests-only")


def test_the_api_root_lists_fleet_and_speculation_routes(user):
    # given a signed-in viewer
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")

    # when
    response = api.get("/api/v1/")

    # then every route is there with its methods
    assert response.status_code == 200
    routes = {r["path"]: r["methods"] for r in response.json()["routes"]}
    for path in (
        "/api/v1/endpoints/",
        "/api/v1/probes/",
        "/api/v1/endpoints/{pk}/policy/",
        "/api/v1/endpoints/{pk}/timeseries/",
        "/api/v1/drafts/",
        "/api/v1/stage-records/",
        "/api/v1/training-runs/",
        "/api/v1/fleet-summary/",
    ):
        assert path in routes, path
    assert routes["/api/v1/endpoints/{pk}/policy/"] == ["GET", "PATCH", "PUT"]


def test_the_api_root_needs_a_signed_in_user():
    assert APIClient().get("/api/v1/").status_code == 401


def test_schema_and_docs_need_a_sign_in_by_default(settings):
    # given the default
    settings.API_DOCS_PUBLIC = False

    # when an anonymous client asks
    schema = APIClient().get("/api/schema/")
    docs = Client().get("/api/docs/")

    # then
    assert schema.status_code == 401
    assert docs.status_code == 302
    assert docs["Location"].startswith("/login/")


def test_schema_and_docs_are_served_to_a_signed_in_user(settings, user):
    settings.API_DOCS_PUBLIC = False
    browser = Client()
    browser.force_login(user)

    assert browser.get("/api/schema/").status_code == 200
    assert browser.get("/api/docs/").status_code == 200


def test_schema_and_docs_are_public_when_the_setting_says_so(settings):
    settings.API_DOCS_PUBLIC = True

    assert APIClient().get("/api/schema/").status_code == 200
    assert Client().get("/api/docs/").status_code == 200
