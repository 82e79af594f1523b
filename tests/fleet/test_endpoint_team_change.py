"""Only an endpoint's owner or an admin may change its team: a team-mate cannot lock the team out.

Why: a team-mate operator PATCHing `team: null` (or another of its teams) onto the owner's endpoint would take it
from the rest of the team.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from fleet import services
from fleet.models import Endpoint
from fleet.permissions import ADMIN, OPERATOR
from tests.support.users import api_as, browser_as, make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def alice():
    return make_user("alice", OPERATOR, teams=("ml",))


@pytest.fixture
def endpoint(alice) -> Endpoint:
    return services.create_endpoint(
        name="llama", base_url="http://127.0.0.1:8000", created_by=alice, team=Group.objects.get(name="ml")
    )


@pytest.mark.parametrize("team", [None, "side"])
def test_a_team_mate_cannot_take_the_endpoint_away_from_the_team(endpoint, team):
    # given carl, an operator of ml (and of another team)
    carl = make_user("carl", OPERATOR, teams=("ml", "side"))

    # when carl clears the team, or moves the endpoint to his other team
    response = api_as(carl).patch(f"/api/v1/endpoints/{endpoint.pk}/", {"team": team}, format="json")

    # then it is refused and the team keeps it
    assert response.status_code == 400
    assert "owner" in response.json()["team"][0]
    endpoint.refresh_from_db()
    assert endpoint.team.name == "ml"


def test_a_team_mate_may_still_change_other_settings_and_send_the_team_unchanged(endpoint):
    carl = make_user("carl", OPERATOR, teams=("ml",))

    body = {"team": "ml", "node_class": "a100"}
    response = api_as(carl).patch(f"/api/v1/endpoints/{endpoint.pk}/", body, format="json")

    assert response.status_code == 200, response.content
    endpoint.refresh_from_db()
    assert (endpoint.team.name, endpoint.node_class) == ("ml", "a100")


def test_the_edit_page_offers_a_team_mate_no_team_field(endpoint):
    carl = make_user("carl", OPERATOR, teams=("ml",))
    browser = browser_as(carl)

    page = browser.get(f"/fleet/{endpoint.pk}/edit/").content.decode()
    form = {"name": "llama", "base_url": "http://127.0.0.1:8000", "kind": "vllm", "node_class": "cpu", "team": ""}
    browser.post(f"/fleet/{endpoint.pk}/edit/", form)

    assert 'name="team"' not in page
    endpoint.refresh_from_db()
    assert endpoint.team.name == "ml"


def test_the_owner_and_an_admin_may_change_the_team(alice, endpoint):
    admin = make_user("boss", ADMIN)

    cleared = api_as(alice).patch(f"/api/v1/endpoints/{endpoint.pk}/", {"team": None}, format="json")
    given = api_as(admin).patch(f"/api/v1/endpoints/{endpoint.pk}/", {"team": "ml"}, format="json")

    assert (cleared.status_code, given.status_code) == (200, 200)
    endpoint.refresh_from_db()
    assert endpoint.team.name == "ml"
