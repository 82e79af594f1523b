"""JSON bodies nested too deep, or too large, on every REST write route: a 400 / 413 naming the problem.

Why: `[[[[...]]]]` about 1,000 deep makes DRF's parser raise RecursionError (a 500 without the limit), and a body
over the size limit otherwise gets Django's HTML error page.
"""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from ace import json_body
from ace.api import api_routes
from fleet import services

pytestmark = pytest.mark.django_db

VERY_DEEP = ("[" * 100_000 + "]" * 100_000).encode()
JUST_TOO_DEEP = json.dumps({"name": json.loads("[" * json_body.MAX_DEPTH + "]" * json_body.MAX_DEPTH)}).encode()
WRITES = ("POST", "PUT", "PATCH")


@pytest.fixture
def admin_api() -> APIClient:
    client = APIClient()
    client.force_authenticate(get_user_model().objects.create_superuser("deep-admin", password="pw-for-tests-only"))
    return client


@pytest.fixture
def endpoint():
    return services.create_endpoint(name="deep", base_url="http://127.0.0.1:8000")


def _write_routes(endpoint_id: int) -> list[tuple[str, str]]:
    routes = []
    for route in api_routes():
        path = str(route["path"]).replace("{pk}", str(endpoint_id)).replace("{id}", str(endpoint_id))
        routes.extend((method, path) for method in route["methods"] if method in WRITES)
    return routes


def _send(client: APIClient, method: str, path: str, body: bytes):
    return client.generic(method, path, body, content_type="application/json")


@pytest.mark.parametrize("body", [VERY_DEEP, JUST_TOO_DEEP], ids=["100000-deep", "65-deep"])
def test_it_answers_no_write_route_with_a_5xx_for_a_deeply_nested_body(admin_api, endpoint, body):
    routes = _write_routes(endpoint.pk)
    assert len(routes) >= 8, routes
    answers = {f"{method} {path}": _send(admin_api, method, path, body).status_code for method, path in routes}
    assert all(status < 500 for status in answers.values()), answers


@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/api/v1/endpoints/"),
        ("PATCH", "/api/v1/endpoints/{pk}/"),
        ("PUT", "/api/v1/endpoints/{pk}/policy/"),
        ("PATCH", "/api/v1/endpoints/{pk}/policy/"),
        ("POST", "/api/v1/drafts/"),
        ("POST", "/api/v1/training-runs/"),
        ("POST", "/api/v1/managed-endpoints/"),
        ("POST", "/api/v1/endpoints/{pk}/autopairing/apply/"),
    ],
)
@pytest.mark.parametrize("body", [VERY_DEEP, JUST_TOO_DEEP], ids=["100000-deep", "65-deep"])
def test_it_refuses_a_body_nested_deeper_than_the_limit_naming_it(admin_api, endpoint, method, path, body):
    response = _send(admin_api, method, path.format(pk=endpoint.pk), body)
    assert response.status_code == 400, response.content
    assert f"nested deeper than {json_body.MAX_DEPTH} levels" in response.json()["detail"]


def test_it_still_accepts_a_body_nested_to_the_limit(admin_api, endpoint):
    # a policy's eagle_tree is an object: depth 2 of the 64 allowed
    response = admin_api.patch(
        f"/api/v1/endpoints/{endpoint.pk}/policy/", {"mode": "off", "eagle_tree": {}}, format="json"
    )
    assert response.status_code == 200, response.content


def test_it_answers_a_body_over_the_size_limit_with_a_json_413(admin_api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    body = json.dumps({"name": "x" * 5000, "base_url": "http://127.0.0.1:8000"}).encode()
    response = _send(admin_api, "POST", "/api/v1/endpoints/", body)
    assert response.status_code == 413
    assert "ACE_MAX_BODY_BYTES" in response.json()["detail"]


def test_loads_reports_depth_at_any_depth_without_recursing():
    assert json_body.depth_problem(json.loads("[" * 64 + "]" * 64)) == ""
    with pytest.raises(json_body.TooDeep, match="nested deeper than 64"):
        json_body.loads("[" * 65 + "]" * 65)
    with pytest.raises(json_body.TooDeep):
        json_body.loads(VERY_DEEP)


def test_it_answers_a_chunked_body_over_the_size_limit_with_a_json_413(settings):
    # no Content-Length, so Django's own check does not apply: the parser counts what it read
    from rest_framework.test import APIRequestFactory

    from ace.json_body import BodyTooLarge, JSONParser

    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    request = APIRequestFactory().post("/", b"[" + b"1," * 4000 + b"1]", content_type="application/json")
    with pytest.raises(BodyTooLarge, match="ACE_MAX_BODY_BYTES"):
        JSONParser().parse(request, parser_context={})
