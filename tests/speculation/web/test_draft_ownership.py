"""Drafts and training runs belong to an owner and a team, as endpoints do: another team neither sees nor deletes
them, and no message names an endpoint or a draft the caller cannot see.

Why: a draft is a company's model and a run's error text speaks of the server's files; without an owner any
operator could delete another team's draft, read every run's error, point a policy at any draft, and learn from a
refusal which endpoints use a draft.
"""

from __future__ import annotations

import pytest
from django.contrib.auth.models import Group

from fleet import services
from fleet.permissions import ADMIN, OPERATOR, VIEWER
from speculation.models import DraftModel, SpeculationPolicy, TrainingRun, TrainingStatus
from tests.support.users import api_as, browser_as, make_user

pytestmark = pytest.mark.django_db

DRAFTS = "/api/v1/drafts/"
RUNS = "/api/v1/training-runs/"


@pytest.fixture
def alice():
    return make_user("alice", OPERATOR, teams=("ml",))


@pytest.fixture
def bob():
    return make_user("bob", OPERATOR, teams=("research",))


def _register(user, name: str, **extra):
    response = api_as(user).post(DRAFTS, {"name": name, "kind": "ngram", **extra}, format="json")
    assert response.status_code == 201, response.content
    return DraftModel.objects.get(name=name)


def test_another_teams_draft_is_not_listed_read_or_deleted(alice, bob):
    # given alice's draft
    draft = _register(alice, "alices-lookup")

    # when bob lists, reads and deletes it, on the API and the drafts page
    api = api_as(bob)
    listing = api.get(DRAFTS).json()["results"]
    read = api.get(f"{DRAFTS}{draft.pk}/")
    delete = api.delete(f"{DRAFTS}{draft.pk}/")
    page = browser_as(bob).get("/dashboard/drafts/").content.decode()

    # then it does not exist for him, and it is still there
    assert listing == []
    assert (read.status_code, delete.status_code) == (404, 404)
    assert "alices-lookup" not in page
    assert DraftModel.objects.filter(pk=draft.pk).exists()
    assert api_as(alice).get(f"{DRAFTS}{draft.pk}/").json()["owner"] == "alice"


def test_a_teams_draft_is_seen_by_its_members_and_deleted_by_its_operators_only(alice):
    # given alice's draft of team ml, a viewer and an operator of ml
    draft = _register(alice, "team-lookup", team="ml")
    viewer = make_user("vera", VIEWER, teams=("ml",))
    mate = make_user("carl", OPERATOR, teams=("ml",))

    # when
    seen = [d["name"] for d in api_as(viewer).get(DRAFTS).json()["results"]]
    refused = api_as(viewer).delete(f"{DRAFTS}{draft.pk}/")
    deleted = api_as(mate).delete(f"{DRAFTS}{draft.pk}/")

    # then
    assert seen == ["team-lookup"]
    assert (refused.status_code, deleted.status_code) == (403, 204)
    assert not DraftModel.objects.filter(pk=draft.pk).exists()


def test_an_operator_cannot_give_a_draft_to_a_team_it_is_not_in(alice):
    Group.objects.create(name="research")

    response = api_as(alice).post(DRAFTS, {"name": "x", "kind": "ngram", "team": "research"}, format="json")

    assert response.status_code == 400
    assert "research" in response.json()["team"][0]
    assert not DraftModel.objects.exists()


def test_a_draft_without_owner_or_team_is_seen_by_admins_only(alice):
    # given a draft registered before drafts had owners (or by the command line)
    DraftModel.objects.create(name="legacy", kind="ngram")
    admin = make_user("boss", ADMIN)

    assert api_as(alice).get(DRAFTS).json()["results"] == []
    assert [d["name"] for d in api_as(admin).get(DRAFTS).json()["results"]] == ["legacy"]


def test_a_policy_naming_a_draft_the_user_cannot_see_is_refused_as_if_it_did_not_exist(alice, bob, tiny_model_dir):
    # given alice's draft model, and bob's endpoint
    response = api_as(alice).post(
        DRAFTS, {"name": "alices-draft", "kind": "draft_model", "path": str(tiny_model_dir)}, format="json"
    )
    assert response.status_code == 201, response.content
    endpoint = services.create_endpoint(name="bobs-ep", base_url="http://127.0.0.1:8000", created_by=bob)
    policy = f"/api/v1/endpoints/{endpoint.pk}/policy/"

    # when bob points his policy at it, and at a draft that does not exist
    hidden = api_as(bob).patch(policy, {"mechanism": "draft_model", "draft": "alices-draft"}, format="json")
    missing = api_as(bob).patch(policy, {"mechanism": "draft_model", "draft": "no-such-draft"}, format="json")

    # then both answers read the same
    assert (hidden.status_code, missing.status_code) == (400, 400)
    assert hidden.json()["draft"][0].replace("alices-draft", "X") == missing.json()["draft"][0].replace(
        "no-such-draft", "X"
    )
    assert not SpeculationPolicy.objects.filter(endpoint=endpoint, draft__isnull=False).exists()
    # and the endpoint page offers only the drafts bob can see
    settings = browser_as(bob).get(f"/dashboard/endpoints/{endpoint.pk}/?view=settings").content.decode()
    assert 'id="policy-form"' in settings and "alices-draft" not in settings


def test_deleting_a_draft_in_use_names_only_the_endpoints_the_caller_can_see(alice, tiny_model_dir):
    # given a draft of team ml, used by the policy of alice's own endpoint (no team)
    response = api_as(alice).post(
        DRAFTS, {"name": "shared", "kind": "draft_model", "path": str(tiny_model_dir), "team": "ml"}, format="json"
    )
    assert response.status_code == 201, response.content
    endpoint = services.create_endpoint(name="alice-ep", base_url="http://127.0.0.1:8000", created_by=alice)
    SpeculationPolicy.objects.create(endpoint=endpoint, mechanism="draft_model", draft=DraftModel.objects.get())
    mate = make_user("carl", OPERATOR, teams=("ml",))

    # when a team-mate who cannot see alice-ep deletes the draft, and then alice does
    theirs = api_as(mate).delete(f"{DRAFTS}{DraftModel.objects.get().pk}/")
    hers = api_as(alice).delete(f"{DRAFTS}{DraftModel.objects.get().pk}/")

    # then both are refused; only alice's answer names her endpoint
    assert (theirs.status_code, hers.status_code) == (400, 400)
    assert "alice-ep" not in theirs.json()["draft"][0]
    assert "in use" in theirs.json()["draft"][0]
    assert "alice-ep" in hers.json()["draft"][0]


def test_another_teams_training_runs_and_their_errors_are_not_shown(alice, bob, tmp_path):
    # given alice's failed run, whose error says something about the server's files
    run = TrainingRun.objects.create(
        name="alices-head", target_dir=str(tmp_path), out_dir=str(tmp_path / "o"), owner=alice,
        status=TrainingStatus.FAILED, error="PromptSourceError: secret-path holds no prompts",
    )  # fmt: skip

    # when bob lists and reads runs, and opens the drafts page that shows them
    api = api_as(bob)
    listing = api.get(RUNS).json()["results"]
    read = api.get(f"{RUNS}{run.pk}/")
    page = browser_as(bob).get("/dashboard/drafts/").content.decode()

    # then nothing of alice's run shows; alice sees it with its error
    assert listing == [] and read.status_code == 404
    assert "alices-head" not in page and "secret-path" not in page
    assert api_as(alice).get(f"{RUNS}{run.pk}/").json()["error"].startswith("PromptSourceError")
    assert "secret-path" in browser_as(alice).get("/dashboard/drafts/").content.decode()


def test_a_queued_run_belongs_to_its_creator_and_the_team_it_names(alice, tiny_model_dir, tmp_path):
    response = api_as(alice).post(
        RUNS, {"target_dir": str(tiny_model_dir), "out_dir": str(tmp_path / "o"), "team": "ml"}, format="json"
    )

    assert response.status_code == 201, response.content
    run = TrainingRun.objects.get()
    assert (run.owner, run.team.name) == (alice, "ml")
    assert response.json()["owner"] == "alice"


def test_the_register_page_gives_a_draft_to_one_of_the_users_teams_only(alice):
    research = Group.objects.create(name="research")
    browser = browser_as(alice)
    form = {"name": "page-lookup", "kind": "ngram", "node_class": "cpu"}

    foreign = browser.post("/dashboard/drafts/", {**form, "team": research.pk})
    own = browser.post("/dashboard/drafts/", {**form, "team": Group.objects.get(name="ml").pk})

    assert foreign.status_code == 400 and "Select a valid choice" in foreign.content.decode()
    assert own.status_code == 302
    draft = DraftModel.objects.get(name="page-lookup")
    assert (draft.owner, draft.team.name) == (alice, "ml")
