"""Ids and offsets beyond a database integer are 400s (or clamped), not driver OverflowErrors (500s).

Found by `manage.py fuzz_api`: `GET /api/v1/probes/?endpoint=<31 digits>&offset=<22 digits>` and
`GET /api/v1/stage-records/?endpoint=<23 digits>` were 500s ("Python int too large to convert to SQLite INTEGER").
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

BIG = 10**30


@pytest.fixture
def admin_api(django_user_model):
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(django_user_model.objects.create_superuser("qp-admin", password="pw-for-tests-only"))
    return client


@pytest.mark.parametrize("path", ["/api/v1/probes/", "/api/v1/stage-records/"])
def test_an_endpoint_filter_beyond_a_database_id_is_a_400_naming_it(admin_api, path):
    response = admin_api.get(path, {"endpoint": str(BIG)})
    assert response.status_code == 400
    assert "must be an id" in response.json()["endpoint"][0]


@pytest.mark.parametrize("path", ["/api/v1/probes/", "/api/v1/stage-records/", "/api/v1/endpoints/"])
def test_an_offset_or_limit_beyond_a_database_integer_is_clamped(admin_api, path):
    response = admin_api.get(path, {"offset": str(BIG), "limit": str(BIG)})
    assert response.status_code == 200
    assert response.json()["results"] == []


def test_an_endpoint_id_that_fits_still_filters(admin_api):
    response = admin_api.get("/api/v1/stage-records/", {"endpoint": "7"})
    assert response.status_code == 200 and response.json()["count"] == 0
