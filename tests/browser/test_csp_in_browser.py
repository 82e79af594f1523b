"""In Debian's chromium, under ACE's Content-Security-Policy: the endpoint page draws its Plotly charts and the
browser reports no violation of the policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet import services
from tests.browser.conftest import CHROMIUM, PASSWORD

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]


def test_the_endpoint_page_draws_its_charts_under_the_policy(live_server, page, django_user_model):
    from playwright.sync_api import expect

    violations: list[str] = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    django_user_model.objects.create_superuser(username="ops", password=PASSWORD)
    endpoint = services.create_endpoint(name="csp-demo", base_url="http://127.0.0.1:8000")

    response = page.goto(f"{live_server.url}/login/?next=/dashboard/endpoints/{endpoint.pk}/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.fill("#id_username", "ops")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")

    expect(page.locator("#chart-acceptance .main-svg").first).to_be_attached()
    assert page.evaluate("Array.isArray(document.getElementById('chart-acceptance').data)")
    assert violations == []
