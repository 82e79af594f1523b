"""Ids and offsets beyond a database integer are 400s (or clamped), not driver OverflowErrors (500s).

Cases `manage.py fuzz_api` finds: `GET /api/v1/probes/?endpoint=<31 digits>&offset=<22 digits>` and
`GET /api/v1/stage-records/?endpoint=<23 digits>` ("Python int too large to convert to SQLite INTEGER" unchecked).
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


# Unicode digits and look-alikes: str.isdigit() accepts "²" (and int() then fails: a 500), int() accepts "１" and
# "٣". An id is ASCII digits only.
NOT_ASCII_DIGITS = ["\u00b2", "\uff11", "\u0663", "1\u00b2", "\u2460", " 7\u200b"]


@pytest.mark.parametrize("path", ["/api/v1/probes/", "/api/v1/stage-records/"])
@pytest.mark.parametrize("value", NOT_ASCII_DIGITS)
def test_it_refuses_an_endpoint_filter_in_unicode_digits_naming_it(admin_api, path, value):
    response = admin_api.get(path, {"endpoint": value})
    assert response.status_code == 400
    assert "must be an id" in response.json()["endpoint"][0]


@pytest.mark.parametrize("value", ["\u00b2", "\uff11", str(BIG)])
def test_it_answers_a_native_flags_draft_in_unicode_digits_without_a_5xx(admin_api, value):
    from fleet import services

    endpoint = services.create_endpoint(name="qp", base_url="http://127.0.0.1:8000")
    response = admin_api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/", {"draft": value})
    assert response.status_code in (400, 404), response.content


@pytest.mark.parametrize("route", ["endpoints", "probes", "drafts", "stage-records", "training-runs"])
@pytest.mark.parametrize("value", ["%C2%B2", "%EF%BC%91", str(BIG)])
def test_it_answers_a_detail_route_with_an_odd_id_with_a_404(admin_api, route, value):
    assert admin_api.get(f"/api/v1/{route}/{value}/").status_code == 404


@pytest.mark.parametrize("name", ["since", "until"])
@pytest.mark.parametrize("value", ["2026-13-45T00:00:00Z", "2026-02-30T00:00:00Z", "2026-01-01T25:61:00Z", "yesterday"])
def test_it_refuses_an_impossible_or_unreadable_date_naming_it(admin_api, name, value):
    response = admin_api.get("/api/v1/stage-records/", {name: value})
    assert response.status_code == 400
    assert "ISO 8601" in response.json()[name][0]


def test_a_real_date_still_filters(admin_api):
    response = admin_api.get("/api/v1/stage-records/", {"since": "2026-01-31T12:00:00Z", "until": "2026-02-01T00:00Z"})
    assert response.status_code == 200


@pytest.mark.parametrize("name", ["c", "v"])
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999", "\u00b2", "x"])
def test_it_refuses_a_projection_cost_that_is_no_finite_number_naming_it(admin_api, name, value):
    # float() reads "nan" and "inf"; JSON cannot carry them (the renderer raised: a 500)
    from fleet import services

    endpoint = services.create_endpoint(name="proj", base_url="http://127.0.0.1:9")
    response = admin_api.get(f"/api/v1/endpoints/{endpoint.pk}/projection/", {name: value})
    assert response.status_code == 400
    assert "finite number" in response.json()[name][0]


def test_the_projection_page_ignores_a_cost_that_is_no_finite_number(admin_api, client, django_user_model):
    from fleet import services

    endpoint = services.create_endpoint(name="proj", base_url="http://127.0.0.1:9")
    client.force_login(django_user_model.objects.get(username="qp-admin"))
    for value in ("nan", "inf", "1e999"):
        assert client.get(f"/dashboard/endpoints/{endpoint.pk}/projection/", {"c": value}).status_code == 200
