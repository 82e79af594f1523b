"""Roles and ownership: viewers read, operators change only the endpoints they or their teams own, admins all.

Each test first replays what an attacker did before roles existed (any signed-in user could do anything).
"""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from fleet import services
from fleet.models import Endpoint
from fleet.permissions import ADMIN, OPERATOR, VIEWER, role_of
from speculation.models import PolicyChange, SpeculationPolicy
from speculation.web.endpoint_page import VIEWS as ENDPOINT_VIEWS
from tests.support.users import api_as, browser_as, make_user

pytestmark = pytest.mark.django_db

ENDPOINTS = "/api/v1/endpoints/"


_user, _api, _browser = make_user, api_as, browser_as


def _endpoint(owner, name: str = "llama", **kwargs) -> Endpoint:
    return services.create_endpoint(name=name, base_url="http://127.0.0.1:8000", created_by=owner, **kwargs)


@pytest.fixture
def alice():
    return _user("alice", OPERATOR)


@pytest.fixture
def alices_endpoint(alice) -> Endpoint:
    return _endpoint(alice)


def test_it_gives_a_user_without_a_role_group_the_viewer_role():
    # given a plain account, and the run command's kind of admin (a superuser)
    plain = _user("plain", None)
    root = get_user_model().objects.create_superuser("root", password="pw-for-tests-only")

    # then
    assert role_of(plain) == VIEWER
    assert role_of(root) == ADMIN


def test_it_refuses_a_viewer_switching_a_mode(alice, alices_endpoint):
    # given a non-staff account that only reads, although it owns nothing it could not see
    mallory = _user("mallory", VIEWER, teams=("ml",))
    Endpoint.objects.filter(pk=alices_endpoint.pk).update(team=Group.objects.get(name="ml"))

    # when it switches the endpoint to shadow on the REST API and on the dashboard
    rest = _api(mallory).patch(f"/api/v1/endpoints/{alices_endpoint.pk}/policy/", {"mode": "shadow"}, format="json")
    page = _browser(mallory).post(f"/dashboard/endpoints/{alices_endpoint.pk}/mode/", {"mode": "shadow"})

    # then both are refused and nothing changed
    assert rest.status_code == 403
    assert "viewer" in rest.json()["detail"]
    assert page.status_code == 403
    assert not PolicyChange.objects.exists()
    assert not SpeculationPolicy.objects.filter(endpoint=alices_endpoint, mode="shadow").exists()
    # and it still reads
    assert _api(mallory).get(f"{ENDPOINTS}{alices_endpoint.pk}/").status_code == 200


def test_it_refuses_a_viewer_every_write(alices_endpoint):
    # given a viewer that can see the endpoint through its team
    viewer = _user("viewer", VIEWER, teams=("ml",))
    Endpoint.objects.filter(pk=alices_endpoint.pk).update(team=Group.objects.get(name="ml"))
    api = _api(viewer)

    # when / then every write answers 403
    writes = [
        api.post(ENDPOINTS, {"name": "x", "base_url": "http://127.0.0.1:9"}, format="json"),
        api.patch(f"{ENDPOINTS}{alices_endpoint.pk}/", {"node_class": "gpu"}, format="json"),
        api.delete(f"{ENDPOINTS}{alices_endpoint.pk}/"),
        api.post(f"{ENDPOINTS}{alices_endpoint.pk}/probe/"),
        api.post("/api/v1/drafts/", {"name": "d", "kind": "ngram"}, format="json"),
        api.post("/api/v1/training-runs/", {"target_dir": "/tmp", "out_dir": "/tmp/x"}, format="json"),
    ]
    assert [r.status_code for r in writes] == [403] * len(writes)
    browser = _browser(viewer)
    assert browser.post(f"/fleet/{alices_endpoint.pk}/delete/").status_code == 403
    assert browser.get("/fleet/new/").status_code == 403
    assert browser.post("/dashboard/drafts/", {"name": "d", "kind": "ngram", "node_class": "cpu"}).status_code == 403
    assert Endpoint.objects.filter(pk=alices_endpoint.pk, node_class="cpu").exists()


def test_it_refuses_an_operator_deleting_another_owners_endpoint(alices_endpoint):
    # given another operator, in no team of alice's
    bob = _user("bob", OPERATOR)

    # when bob deletes, changes, probes or reads alice's endpoint, on the API and the pages
    api = _api(bob)
    answers = [
        api.delete(f"{ENDPOINTS}{alices_endpoint.pk}/").status_code,
        api.patch(f"{ENDPOINTS}{alices_endpoint.pk}/", {"base_url": "http://10.0.0.9:80"}, format="json").status_code,
        api.post(f"{ENDPOINTS}{alices_endpoint.pk}/probe/").status_code,
        api.get(f"{ENDPOINTS}{alices_endpoint.pk}/").status_code,
        api.patch(f"/api/v1/endpoints/{alices_endpoint.pk}/policy/", {"mode": "shadow"}, format="json").status_code,
        api.get(f"/api/v1/endpoints/{alices_endpoint.pk}/timeseries/?metric=tok_s").status_code,
        _browser(bob).post(f"/fleet/{alices_endpoint.pk}/delete/").status_code,
        _browser(bob).get(f"/dashboard/endpoints/{alices_endpoint.pk}/").status_code,
        *(
            _browser(bob).get(f"/dashboard/endpoints/{alices_endpoint.pk}/?view={v}").status_code
            for v in ENDPOINT_VIEWS
        ),
    ]

    # then every answer is 404 (another owner's endpoint is not revealed) and it still exists unchanged
    assert answers == [404] * len(answers)
    assert Endpoint.objects.filter(pk=alices_endpoint.pk, base_url="http://127.0.0.1:8000").exists()
    assert api.get(ENDPOINTS).json()["results"] == []


def test_it_lets_team_members_operate_the_teams_endpoint(alice):
    # given an endpoint of team ml, and bob, an operator in ml
    ml = Group.objects.create(name="ml")
    alice.groups.add(ml)
    endpoint = _endpoint(alice, team=ml)
    bob = _user("bob", OPERATOR, teams=("ml",))

    # when bob changes it
    response = _api(bob).patch(f"{ENDPOINTS}{endpoint.pk}/", {"node_class": "a100"}, format="json")

    # then
    assert response.status_code == 200, response.content
    assert response.json()["team"] == "ml"
    assert response.json()["owner"] == "alice"
    endpoint.refresh_from_db()
    assert endpoint.node_class == "a100"


def test_it_refuses_an_operator_giving_an_endpoint_to_a_team_it_is_not_in(alice, alices_endpoint):
    # given a team alice is not in, and a role group
    Group.objects.create(name="research")

    # when alice hands her endpoint to them
    api = _api(alice)
    foreign = api.patch(f"{ENDPOINTS}{alices_endpoint.pk}/", {"team": "research"}, format="json")
    role = api.patch(f"{ENDPOINTS}{alices_endpoint.pk}/", {"team": "admin"}, format="json")

    # then
    assert foreign.status_code == 400
    assert "research" in foreign.json()["team"][0]
    assert role.status_code == 400
    alices_endpoint.refresh_from_db()
    assert alices_endpoint.team is None


def test_it_lets_an_admin_see_and_change_every_endpoint(alices_endpoint):
    # given an admin
    admin = _user("boss", ADMIN)

    # when
    api = _api(admin)
    listing = api.get(ENDPOINTS).json()["results"]
    change = api.patch(f"/api/v1/endpoints/{alices_endpoint.pk}/policy/", {"k": 3}, format="json")

    # then
    assert [e["name"] for e in listing] == ["llama"]
    assert change.status_code == 200, change.content
    assert admin.is_staff  # the admin role also opens the Django admin (users, tokens)


def test_the_admin_site_shows_an_operator_only_its_endpoints(alices_endpoint):
    # given a staff operator (the Django admin is open to it) who owns nothing
    bob = _user("bob", OPERATOR)
    bob.is_staff = True
    bob.save()

    # when
    browser = _browser(bob)
    listing = browser.get("/admin/fleet/endpoint/")
    detail = browser.get(f"/admin/fleet/endpoint/{alices_endpoint.pk}/change/")
    delete = browser.post(f"/admin/fleet/endpoint/{alices_endpoint.pk}/delete/", {"post": "yes"})

    # then
    assert listing.status_code == 200
    assert "llama" not in listing.content.decode()
    assert detail.status_code in (302, 404)  # the admin redirects an object it cannot see to its index
    assert delete.status_code in (302, 404)
    assert Endpoint.objects.filter(pk=alices_endpoint.pk).exists()


def test_the_data_migration_gives_existing_endpoints_to_their_creators():
    # given an endpoint registered before ownership existed (created_by set, no owner), by a plain user
    creator = _user("old-timer", None)
    endpoint = Endpoint.objects.create(name="legacy", base_url="http://127.0.0.1:9", created_by=creator)
    migration = importlib.import_module("fleet.migrations.0002_ownership_and_token_scope")

    # when the data migration runs
    migration.own_existing_endpoints(apps, None)

    # then the creator owns and keeps operating it
    endpoint.refresh_from_db()
    creator = get_user_model().objects.get(pk=creator.pk)
    assert endpoint.owner == creator
    assert role_of(creator) == OPERATOR


def test_ace_token_keeps_working_and_sets_roles_and_teams(capsys):
    # given the run command's admin
    get_user_model().objects.create_superuser("admin", password="pw-for-tests-only")

    # when
    call_command("ace_token", "admin")
    admin_key = capsys.readouterr().out.strip()
    call_command("ace_token", "ci", "--create", "--role", "operator", "--team", "ml")
    ci_key = capsys.readouterr().out.strip()

    # then
    assert Token.objects.get(key=admin_key).user.username == "admin"
    ci = get_user_model().objects.get(username="ci")
    assert Token.objects.get(key=ci_key).user == ci
    assert role_of(ci) == OPERATOR
    assert ci.groups.filter(name="ml").exists()


def test_the_pages_offer_a_viewer_no_write_controls(alices_endpoint):
    # given a viewer in the endpoint's team, and its operator
    viewer = _user("viewer", VIEWER, teams=("ml",))
    Endpoint.objects.filter(pk=alices_endpoint.pk).update(team=Group.objects.get(name="ml"))
    alice = get_user_model().objects.get(username="alice")

    # when both open the endpoint's pages
    def pages(user) -> str:
        browser = _browser(user)
        urls = (
            "/fleet/",
            f"/fleet/{alices_endpoint.pk}/",
            "/dashboard/",
            f"/dashboard/endpoints/{alices_endpoint.pk}/",
            *(f"/dashboard/endpoints/{alices_endpoint.pk}/?view={view}" for view in ENDPOINT_VIEWS),
        )
        return "".join(browser.get(url).content.decode() for url in urls)

    # then the viewer sees the endpoint but no control that would write
    seen, operated = pages(viewer), pages(alice)
    assert "llama" in seen
    for control in ('id="reprobe"', "Register an endpoint", "Save settings"):
        assert control in operated, control
        assert control not in seen, control


def test_lists_show_an_operator_only_the_data_of_endpoints_it_can_see(alices_endpoint):
    # given a stage record of alice's endpoint, and bob, an operator of another team
    from speculation.models import StageRecord

    StageRecord.objects.create(endpoint=alices_endpoint, request_id="r1", mode="off", action="skipped")
    bob = _user("bob", OPERATOR)

    # when bob lists probes, stage records and the fleet summary
    api = _api(bob)
    probes = api.get("/api/v1/probes/").json()["results"]
    records = api.get("/api/v1/stage-records/").json()["results"]
    summary = api.get("/api/v1/fleet-summary/").json()

    # then nothing of alice's shows; alice herself sees them
    assert (probes, records, summary) == ([], [], [])
    assert (
        len(_api(get_user_model().objects.get(username="alice")).get("/api/v1/stage-records/").json()["results"]) == 1
    )


def test_the_register_page_gives_an_endpoint_to_one_of_the_users_teams_only():
    # given an operator in team ml, and a team it is not in
    carol = _user("carol", OPERATOR, teams=("ml",))
    research = Group.objects.create(name="research")
    browser = _browser(carol)
    form = {"name": "llama", "base_url": "http://127.0.0.1:8000", "kind": "vllm", "node_class": "cpu"}

    # when it tries the foreign team, then its own
    foreign = browser.post("/fleet/new/", {**form, "team": research.pk})
    own = browser.post("/fleet/new/", {**form, "team": Group.objects.get(name="ml").pk})

    # then the foreign team is not a choice, and its own is saved
    assert foreign.status_code == 200
    assert "Select a valid choice" in foreign.content.decode()
    assert own.status_code == 302
    endpoint = Endpoint.objects.get(name="llama")
    assert (endpoint.owner, endpoint.team.name) == (carol, "ml")
