"""Unknown fields in an endpoint or policy PUT/PATCH answer 400 naming them.

Why: `{"modee": "prod"}` must not answer 200 and change nothing, silently.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet import services
from fleet.models import Endpoint
from fleet.permissions import OPERATOR, grant_role
from speculation.models import PolicyChange

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


@pytest.fixture
def endpoint(user) -> Endpoint:
    return services.create_endpoint(name="llama", base_url="http://127.0.0.1:8000", created_by=user)


def test_a_policy_patch_with_a_misspelt_field_is_refused_naming_it(api, endpoint):
    # when
    response = api.patch(f"/api/v1/endpoints/{endpoint.pk}/policy/", {"modee": "shadow", "kk": 3}, format="json")

    # then
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"modee", "kk"}
    assert "Unknown field 'modee'" in body["modee"][0]
    assert "mode" in body["modee"][0]  # it lists what can be set
    assert not PolicyChange.objects.exists()


def test_a_policy_patch_may_send_back_read_only_fields_it_got(api, endpoint):
    policy = api.get(f"/api/v1/endpoints/{endpoint.pk}/policy/").json()

    response = api.patch(f"/api/v1/endpoints/{endpoint.pk}/policy/", {**policy, "k": 4}, format="json")

    assert response.status_code == 200, response.content
    assert response.json()["k"] == 4


def test_an_endpoint_patch_with_an_unknown_field_is_refused_naming_it(api, endpoint):
    # when
    response = api.patch(f"/api/v1/endpoints/{endpoint.pk}/", {"node_clas": "a100"}, format="json")

    # then
    assert response.status_code == 400
    assert "Unknown field 'node_clas'" in response.json()["node_clas"][0]
    endpoint.refresh_from_db()
    assert endpoint.node_class == "cpu"
