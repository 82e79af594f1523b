"""The policy's EAGLE draft tree (eagle_tree): REST and the settings form store a valid shape, refuse nonsense with
a 400 naming the field, and a mechanism other than an EAGLE head never keeps a tree."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from fleet.models import Endpoint
from fleet.permissions import ADMIN, grant_role
from speculation.limits import tree_shape_problems
from speculation.models import PolicyChange, SpeculationPolicy

pytestmark = pytest.mark.django_db

TREE = {"top_k": 4, "depth": 6, "nodes": 24}


@pytest.fixture
def endpoint() -> Endpoint:
    return Endpoint.objects.create(name="ep", base_url="http://127.0.0.1:9", status="ready", served_model="m")


def _url(endpoint: Endpoint) -> str:
    return f"/api/v1/endpoints/{endpoint.pk}/policy/"


def test_a_tree_for_an_eagle_head_is_stored_returned_and_recorded(api, endpoint):
    # when: an operator sets a tree on an EAGLE-head policy (off: no draft needed yet)
    response = api.patch(_url(endpoint), {"mechanism": "eagle_head", "eagle_tree": TREE}, format="json")
    # then: stored as sent, and the change is in the history
    assert response.status_code == 200, response.json()
    assert response.json()["eagle_tree"] == TREE
    assert api.get(_url(endpoint)).json()["eagle_tree"] == TREE
    assert PolicyChange.objects.get().changes["eagle_tree"] == [{}, TREE]


@pytest.mark.parametrize(
    ("tree", "says"),
    [
        ({"top_k": 0, "depth": 6, "nodes": 24}, "top_k must be an integer in [1, 8]"),
        ({"top_k": 4, "depth": 17, "nodes": 24}, "depth must be an integer in [1, 16]"),
        ({"top_k": 4, "depth": 6, "nodes": 65}, "nodes must be an integer in [1, 64]"),
        ({"top_k": 4, "depth": 6}, "needs nodes"),
        ({"top_k": True, "depth": 6, "nodes": 24}, "top_k must be an integer"),
        ({"top_k": 2.5, "depth": 6, "nodes": 24}, "top_k must be an integer"),
        ({**TREE, "width": 3}, "unknown field 'width'"),
        ({**TREE, "score_temperature": 0}, "score_temperature must be a number in (0, 10]"),
        ({"top_k": 2, "depth": 2, "nodes": 24}, "exceeds what top_k 2 and depth 2 expand (6)"),
        ("4,6,24", "must be an object"),
        ([4, 6, 24], "must be an object"),
    ],
)
def test_nonsense_trees_are_refused_with_a_400_naming_the_problem(api, endpoint, tree, says):
    response = api.patch(_url(endpoint), {"mechanism": "eagle_head", "eagle_tree": tree}, format="json")
    assert response.status_code == 400
    assert says in " ".join(response.json()["eagle_tree"]), response.json()
    assert SpeculationPolicy.objects.get(endpoint=endpoint).eagle_tree == {}


def test_a_tree_for_a_draft_model_or_ngram_is_refused(api, endpoint):
    response = api.patch(_url(endpoint), {"mechanism": "ngram", "eagle_tree": TREE}, format="json")
    assert response.status_code == 400
    assert "drafts with an EAGLE head" in response.json()["eagle_tree"][0]


def test_leaving_the_eagle_head_clears_its_tree_and_says_so(api, endpoint):
    api.patch(_url(endpoint), {"mechanism": "eagle_head", "eagle_tree": TREE}, format="json")
    response = api.patch(_url(endpoint), {"mechanism": "ngram"}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["eagle_tree"] == {}
    assert PolicyChange.objects.first().changes["eagle_tree"] == [TREE, {}]


def test_an_empty_tree_is_a_chain_and_valid_for_every_mechanism():
    assert tree_shape_problems({}) == [] and tree_shape_problems(None) == []
    assert tree_shape_problems({"top_k": 1, "depth": 8, "nodes": 8}) == []  # a chain of 8 as a tree


# --- the settings form ---------------------------------------------------------------------------------------


@pytest.fixture
def client_in(client):
    user = get_user_model().objects.create_user("ops", password="pw-for-tests-only")
    grant_role(user=user, role=ADMIN)
    client.force_login(user)
    return client


def _form(tree: str) -> dict:
    return {
        "mode": "off",
        "mechanism": "eagle_head",
        "k": 5,
        "shadow_sample_rate": 1,
        "path": "auto",
        "eagle_tree": tree,
    }


def test_the_settings_form_saves_a_tree_and_shows_it_on_the_page(client_in, endpoint):
    response = client_in.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), _form("2,8,12,0.3"))
    assert response.status_code == 302
    stored = SpeculationPolicy.objects.get(endpoint=endpoint).eagle_tree
    assert stored == {"top_k": 2, "depth": 8, "nodes": 12, "score_temperature": 0.3}
    page = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]))
    assert 'id="eagle-tree"' in page.content.decode()
    assert "depth 8 (capped by K = 5)" in page.content.decode()
    settings = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "settings"})
    assert settings.context["form"]["eagle_tree"].value() == "2,8,12,0.3"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("4,six,24", "three whole numbers"),
        ("4,6", "three whole numbers"),
        ("9,6,24", "top_k must be an integer"),
        ("\u00b2,6,24", "three whole numbers"),  # isdigit() but not int()
        ("\uff14,6,24", "three whole numbers"),  # a fullwidth 4
    ],
)
def test_the_settings_form_refuses_nonsense_on_the_field(client_in, endpoint, text, says):
    response = client_in.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), _form(text))
    assert response.status_code == 400
    assert says in " ".join(response.context["form"].errors["eagle_tree"])
    assert [p.eagle_tree for p in SpeculationPolicy.objects.filter(endpoint=endpoint)] in ([], [{}])
