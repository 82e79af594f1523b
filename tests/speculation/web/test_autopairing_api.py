"""Auto-pairing over REST: the table for anyone who sees the endpoint; applying it is a policy write."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.models import Endpoint, EndpointStatus
from fleet.permissions import OPERATOR, VIEWER, grant_role
from speculation.models import CandidateMeasurement, DraftKind, DraftModel, PolicyChange, SpeculationPolicy

pytestmark = pytest.mark.django_db

FP = "a" * 64
TEAM = "search"


def _client(role: str) -> APIClient:
    user = get_user_model().objects.create_user(f"u-{role}", password="pw-for-tests-only")
    grant_role(user=user, role=role)
    user.groups.add(Group.objects.get_or_create(name=TEAM)[0])  # the endpoint's team
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def endpoint():
    endpoint = Endpoint.objects.create(
        name="pairs", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY,
        capabilities={"tokenizer_fingerprint": FP}, team=Group.objects.get_or_create(name=TEAM)[0],
    )  # fmt: skip
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="shadow", mechanism="ngram", k=5)
    draft = DraftModel.objects.create(
        name="small", kind=DraftKind.DRAFT_MODEL, path="/x", tokenizer_fingerprint=FP, team=endpoint.team
    )  # the team's: a draft of no team is for admins only
    # the draft wins at K = 3 (1.6x) over n-gram (1.1x) on 6 requests of workload "chat"
    for i in range(6):
        for name, kind, the_draft, peak in (("small", "draft_model", draft, 1.6), ("ngram", "ngram", None, 1.1)):
            CandidateMeasurement.objects.create(
                endpoint=endpoint, request_id=f"r{i}", workload="chat", candidate=name, kind=kind, draft=the_draft,
                multiplier=[round(peak - 0.1 * abs(k - 3) + 0.01 * (i % 2), 4) for k in range(1, 9)],
                mean_accepted_len=[2.0] * 8, counts=[[k, 1, 3] for k in range(1, 9)],
            )  # fmt: skip
    return endpoint


def test_the_table_lists_workloads_cells_and_the_recommendation(endpoint):
    data = _client(VIEWER).get(f"/api/v1/endpoints/{endpoint.pk}/autopairing/").json()
    chat = data["workloads"]["chat"]
    assert {c["candidate"] for c in chat["cells"]} == {"small", "ngram"}
    assert (chat["recommendation"]["candidate"], chat["recommendation"]["k"]) == ("small", 3)
    assert data["overall"]["recommendation"]["candidate"] == "small"


def test_a_viewer_may_not_apply_it(endpoint):
    response = _client(VIEWER).post(f"/api/v1/endpoints/{endpoint.pk}/autopairing/apply/", {}, format="json")
    assert response.status_code == 403
    assert endpoint.policy.__class__.objects.get(pk=endpoint.policy.pk).mechanism == "ngram"


def test_an_operator_applies_it_in_one_call_and_the_change_is_recorded(endpoint):
    response = _client(OPERATOR).post(
        f"/api/v1/endpoints/{endpoint.pk}/autopairing/apply/", {"workload": "chat"}, format="json"
    )
    assert response.status_code == 200, response.json()
    policy = SpeculationPolicy.objects.get(endpoint=endpoint)
    assert (policy.mechanism, policy.draft.name, policy.k) == ("draft_model", "small", 3)
    change = PolicyChange.objects.get(policy=policy)
    assert change.changes["draft"] == [None, "small"] and change.changed_by.username == "u-operator"


def test_an_unknown_or_bad_workload_is_a_400_naming_it(endpoint):
    client = _client(OPERATOR)
    url = f"/api/v1/endpoints/{endpoint.pk}/autopairing/apply/"
    unknown = client.post(url, {"workload": "nope"}, format="json")
    bad = client.post(url, {"workload": "x" * 100}, format="json")
    assert unknown.status_code == 400 and "nope" in str(unknown.json()["workload"])
    assert bad.status_code == 400 and "at most 64" in str(bad.json()["workload"])


def test_the_endpoint_page_shows_the_table_and_applies_with_one_click(client, endpoint):
    user = get_user_model().objects.create_user("clicker", password="pw-for-tests-only")
    grant_role(user=user, role=OPERATOR)
    user.groups.add(Group.objects.get_or_create(name=TEAM)[0])
    client.force_login(user)

    page = client.get(f"/dashboard/endpoints/{endpoint.pk}/?view=autopairing").content.decode()
    applied = client.post(f"/dashboard/endpoints/{endpoint.pk}/autopairing/apply/", {"workload": "chat"})

    assert 'id="autopairing-table"' in page and 'data-candidate="small"' in page
    assert "<b>small</b> at K = <b>3</b>" in page and 'id="apply-pairing"' in page
    assert applied.status_code == 302 and applied["Location"].endswith("?view=autopairing")
    assert SpeculationPolicy.objects.get(endpoint=endpoint).draft.name == "small"


def test_a_draft_the_team_cannot_see_is_not_applied(endpoint):
    # given the winning draft belongs to nobody (admins only)
    DraftModel.objects.filter(name="small").update(team=None)

    response = _client(OPERATOR).post(
        f"/api/v1/endpoints/{endpoint.pk}/autopairing/apply/", {"workload": "chat"}, format="json"
    )

    assert response.status_code == 400
    assert "no longer registered" in response.json()["draft"][0]
    assert SpeculationPolicy.objects.get(endpoint=endpoint).draft is None
