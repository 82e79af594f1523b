"""Captured traffic over REST: its team's admins read sizes and delete it; nobody else (another team's admin: 404,
a viewer or operator of the team: 403); no route returns the captured tokens; a bad setting is a 400 naming it."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from fleet.permissions import ADMIN, OPERATOR, VIEWER
from speculation.models import CapturedRequest, CaptureSetting
from speculation.services import captures
from tests.support.users import api_as, make_user

pytestmark = pytest.mark.django_db

PROMPT, OUTPUT = [7001, 7002, 7003], [7004, 7005]


@pytest.fixture
def endpoint():
    from django.contrib.auth.models import Group

    endpoint = Endpoint.objects.create(
        name="team-ep", base_url="http://127.0.0.1:9", kind="vllm", team=Group.objects.get_or_create(name="red")[0]
    )
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0)
    rows = [dict(endpoint_id=endpoint.pk, workload=w, mode="off", prompt_ids=PROMPT, output_ids=OUTPUT)
            for w in ("chat", "chat", "code")]  # fmt: skip
    captures.write_captures(rows)
    return endpoint


def _urls(endpoint) -> tuple[str, str]:
    return f"/api/v1/endpoints/{endpoint.pk}/capture/", f"/api/v1/endpoints/{endpoint.pk}/captures/"


def test_a_team_admin_reads_sizes_per_workload_and_never_the_tokens(endpoint):
    _, listing = _urls(endpoint)
    response = api_as(make_user("red-admin", ADMIN, teams=("red",))).get(listing)
    assert response.status_code == 200
    body = response.json()
    assert {k: v["requests"] for k, v in body["workloads"].items()} == {"chat": 2, "code": 1}
    assert body["total"]["prompt_tokens"] == 9 and body["total"]["output_tokens"] == 6
    assert "7001" not in response.content.decode()


def test_a_team_admin_turns_capture_on_and_off(endpoint):
    setting, _ = _urls(endpoint)
    client = api_as(make_user("red-admin", ADMIN, teams=("red",)))
    response = client.patch(setting, {"sample_rate": 0.5, "retention_days": 3}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["sample_rate"], response.json()["retention_days"]) == (0.5, 3)
    assert client.patch(setting, {"enabled": False}, format="json").json()["enabled"] is False


@pytest.mark.parametrize(
    ("body", "field"),
    [({"sample_rate": 1.5}, "sample_rate"), ({"retention_days": -1}, "retention_days"),
     ({"max_bytes": 0}, "max_bytes"), ({"rate": 0.5}, "rate")],
)  # fmt: skip
def test_a_bad_setting_is_a_400_naming_the_field(endpoint, body, field):
    setting, _ = _urls(endpoint)
    response = api_as(make_user("red-admin", ADMIN, teams=("red",))).patch(setting, body, format="json")
    assert response.status_code == 400
    assert field in response.json()
    assert CaptureSetting.objects.get(endpoint=endpoint).sample_rate == 1.0


def test_a_team_admin_deletes_one_workloads_captures_or_all(endpoint):
    _, listing = _urls(endpoint)
    client = api_as(make_user("red-admin", ADMIN, teams=("red",)))
    assert client.delete(listing + "?workload=chat").json() == {"deleted": 2}
    assert client.delete(listing).json() == {"deleted": 1}
    assert not CapturedRequest.objects.exists()


def test_another_teams_admin_can_neither_read_nor_delete_them(endpoint):
    client = api_as(make_user("blue-admin", ADMIN, teams=("blue",)))
    setting, listing = _urls(endpoint)
    assert client.get(setting).status_code == 404 and client.get(listing).status_code == 404
    assert client.patch(setting, {"enabled": False}, format="json").status_code == 404
    assert client.delete(listing).status_code == 404
    assert CapturedRequest.objects.count() == 3
    assert CaptureSetting.objects.get(endpoint=endpoint).enabled


@pytest.mark.parametrize("role", [VIEWER, OPERATOR])
def test_a_viewer_or_operator_of_the_team_can_neither_read_nor_delete_them(endpoint, role):
    client = api_as(make_user(f"red-{role}", role, teams=("red",)))
    setting, listing = _urls(endpoint)
    assert client.get(listing).status_code == 403
    assert client.get(setting).status_code == 403
    assert client.delete(listing).status_code == 403
    assert client.patch(setting, {"enabled": False}, format="json").status_code == 403
    assert CapturedRequest.objects.count() == 3


def test_a_user_of_another_team_does_not_learn_the_endpoint_exists(endpoint):
    client = api_as(make_user("blue-viewer", VIEWER, teams=("blue",)))
    assert client.get(_urls(endpoint)[1]).status_code == 404


def test_the_settings_view_shows_sizes_to_the_teams_admins_only(endpoint):
    from django.urls import reverse

    from tests.support.users import browser_as

    url = reverse("speculation:endpoint", args=[endpoint.pk]) + "?view=settings"
    page = browser_as(make_user("red-admin", ADMIN, teams=("red",))).get(url).content.decode()
    assert 'id="captures"' in page and 'data-workload="chat"' in page and "7001" not in page
    for who, role, teams in (("red-op", OPERATOR, ("red",)), ("blue-admin", ADMIN, ("blue",))):
        page = browser_as(make_user(who, role, teams=teams)).get(url)
        assert page.status_code == 200 and 'id="captures"' not in page.content.decode()
