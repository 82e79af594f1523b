"""Every HTML page sends a Content-Security-Policy that allows scripts from ACE's own static files only, and no
page holds an inline script for it to block (chart data rides in json_script blocks, which are data).

The browser check that the charts still draw under it: tests/browser/test_csp.py.
"""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model

from ace.csp import POLICY
from fleet import services
from speculation.web.endpoint_page import VIEWS as ENDPOINT_VIEWS

pytestmark = pytest.mark.django_db

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/(?:ld\+)?json\")[^>]*>", re.I)


@pytest.fixture
def signed_in(client):
    client.force_login(get_user_model().objects.create_superuser("csp-admin", password="pw-for-tests-only"))
    return client


def _pages(endpoint_id: int) -> list[str]:
    return [
        "/fleet/",
        "/fleet/new/",
        f"/fleet/{endpoint_id}/",
        "/dashboard/",
        f"/dashboard/endpoints/{endpoint_id}/",
        *(f"/dashboard/endpoints/{endpoint_id}/?view={view}" for view in ENDPOINT_VIEWS),
        "/dashboard/drafts/",
        "/api/docs/",
        "/admin/",
    ]


def test_it_sends_the_policy_on_the_login_page(client):
    response = client.get("/login/")
    assert response["Content-Security-Policy"] == POLICY
    assert "script-src 'self'" in POLICY and "unsafe-eval" not in POLICY
    assert "'unsafe-inline'" not in POLICY.split("script-src", 1)[1].split(";", 1)[0]


def test_it_sends_the_policy_on_every_page_and_no_page_holds_an_inline_script(signed_in):
    endpoint = services.create_endpoint(name="csp", base_url="http://127.0.0.1:8000")
    for path in _pages(endpoint.pk):
        response = signed_in.get(path, follow=True)
        assert response.status_code == 200, path
        assert response["Content-Security-Policy"] == POLICY, path
        html = response.content.decode()
        assert not INLINE_SCRIPT.search(html), (path, INLINE_SCRIPT.search(html))
        assert not re.search(r"\son[a-z]+=\"", html), path  # no inline event handlers either


def test_json_answers_get_no_page_policy(signed_in):
    assert "Content-Security-Policy" not in signed_in.get("/api/v1/endpoints/")
