"""The endpoint page's views: a tab bar of plain links, the overview by default, each view only its own part."""

from __future__ import annotations

import pytest
from django.urls import reverse

from fleet.permissions import ADMIN
from speculation.web.endpoint_page import VIEWS
from tests.speculation.web.test_dashboard_pages import add_records, endpoint  # noqa: F401 - the fixture
from tests.support.users import browser_as, make_user

pytestmark = pytest.mark.django_db

# what marks each view's own part on the page
MARKS = {
    "overview": 'id="chart-data"',
    "settings": 'id="policy-form"',
    "autopairing": 'id="autopairing"',
    "server": 'id="capabilities"',
    "records": 'id="records-table"',
}


@pytest.fixture
def browser():
    return browser_as(make_user("ops", ADMIN))


def test_it_shows_the_overview_by_default_and_links_every_view(browser, endpoint):  # noqa: F811
    add_records(endpoint, 3)
    url = reverse("speculation:endpoint", args=[endpoint.pk])

    body = browser.get(url).content.decode()

    assert MARKS["overview"] in body and 'data-view="overview" class="active"' in body
    for name in VIEWS:
        assert f'data-view="{name}"' in body, name
    assert not [name for name, mark in MARKS.items() if name != "overview" and mark in body]


@pytest.mark.parametrize("view", list(VIEWS))
def test_each_view_shows_its_own_part_and_no_other(browser, endpoint, view):  # noqa: F811
    add_records(endpoint, 3)

    response = browser.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": view})

    body = response.content.decode()
    assert response.status_code == 200
    assert MARKS[view] in body and f'data-view="{view}" class="active"' in body
    assert [name for name, mark in MARKS.items() if mark in body] == [view]
    assert 'id="current-mode"' in body  # the mode is in the tab bar of every view


def test_the_tabs_keep_the_chosen_range_and_workload(browser, endpoint):  # noqa: F811
    response = browser.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"range": "week", "workload": "chat"})

    urls = {tab["name"]: tab["url"] for tab in response.context["tabs"]}
    assert urls["records"].endswith("?view=records&range=week&workload=chat")
    assert "view=" not in urls["overview"] and "range=week" in urls["overview"]


def test_it_answers_an_unknown_view_with_a_400_naming_the_choices(browser, endpoint):  # noqa: F811
    response = browser.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "everything"})

    assert response.status_code == 400
    assert "unknown view 'everything'" in response.content.decode() and "records" in response.content.decode()


def test_a_failed_settings_form_comes_back_on_the_settings_view(browser, endpoint):  # noqa: F811
    form = {"mode": "shadow", "mechanism": "ngram", "k": 99, "shadow_sample_rate": 1, "path": "auto"}

    response = browser.post(reverse("speculation:endpoint-policy", args=[endpoint.pk]), form)

    assert response.status_code == 400 and response.context["view"] == "settings"
    assert 'id="policy-form"' in response.content.decode()
