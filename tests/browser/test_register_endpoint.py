"""In Debian's chromium: an operator logs in, registers the real vLLM through the form, and watches it turn ready.

Everything is real: the live Django server (a thread of this process), a Celery worker process on the same
file test database, Redis, and vLLM serving the demo target. The page is never reloaded by the test: the
status panel must update by itself (polling), which the test proves with a marker set on `window`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleet.permissions import OPERATOR, grant_role
from tests.browser.conftest import CHROMIUM, PASSWORD, READY_TIMEOUT_MS

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]


def _log_in(page, live_server, django_user_model, next_path: str) -> None:
    grant_role(user=django_user_model.objects.create_user(username="ops", password=PASSWORD), role=OPERATOR)
    page.goto(f"{live_server.url}{next_path}")
    page.fill("#id_username", "ops")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")


def test_the_api_docs_render_swagger_ui_from_local_assets(live_server, page, django_user_model):
    from playwright.sync_api import expect

    _log_in(page, live_server, django_user_model, "/login/?next=/api/docs/")

    expect(page.locator(".swagger-ui .info .title")).to_contain_text("ACE speculative decoding API")
    expect(page.locator(".opblock-summary-path", has_text="/api/v1/endpoints/").first).to_be_visible()


@pytest.mark.vllm
@pytest.mark.worker
@pytest.mark.slow
def test_an_operator_registers_the_real_vllm_and_sees_it_become_ready(
    live_server, celery_worker, vllm_server, page, django_user_model, artifacts_dir
):
    from playwright.sync_api import expect

    # given an operator account and nothing registered
    grant_role(user=django_user_model.objects.create_user(username="ops", password=PASSWORD), role=OPERATOR)

    # when they open the fleet, they are sent to log in first
    page.goto(f"{live_server.url}/fleet/")
    expect(page).to_have_url(re.compile(r"/login/\?next=/fleet/"))
    page.fill("#id_username", "ops")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    expect(page.get_by_text("No endpoint registered yet")).to_be_visible()

    # a URL outside the allowed networks is refused on the form, with the reason
    page.get_by_role("link", name="Register an endpoint").first.click()
    page.fill("#id_name", "metadata")
    page.fill("#id_base_url", "http://169.254.169.254/")
    page.click("text=Register and probe")
    expect(page.locator("#field-base_url .field-error")).to_contain_text("outside the allowed networks")

    # then they register the real vLLM
    page.fill("#id_name", "demo-vllm")
    page.fill("#id_base_url", vllm_server.base_url)
    page.select_option("#id_kind", "vllm")
    page.fill("#id_node_class", "cpu")
    page.fill("#id_api_key", "sk-browser-secret-0000")
    page.click("text=Register and probe")
    expect(page.locator("h1")).to_have_text("demo-vllm")
    page.evaluate("window.__aceNoReload = true")

    # the status panel turns ready by itself, with the capabilities the probe found
    status = page.locator("#endpoint-status .status-line [data-status]")
    expect(status).to_have_attribute("data-status", "ready", timeout=READY_TIMEOUT_MS)
    expect(page.locator("#served-model")).to_have_text(vllm_server.model)
    expect(page.locator("tr[data-capability=max_context] td")).to_have_text("1024")
    expect(page.locator("tr[data-capability=prompt_scoring] td")).to_have_text("yes")
    expect(page.locator("tr[data-capability=native_speculation] td")).to_have_text("no")
    expect(page.locator("#probe-history tbody tr")).to_have_count(1)
    assert page.evaluate("window.__aceNoReload === true"), "the page was reloaded instead of updated in place"
    html = page.content()
    assert "sk-browser-secret-0000" not in html

    page.screenshot(path=str(artifacts_dir / "register_endpoint_ready.png"), full_page=True)

    # and the fleet list shows it ready with its served model
    page.click("nav >> text=Fleet")
    row = page.locator("tr[data-endpoint=demo-vllm]")
    expect(row).to_contain_text("Ready")
    expect(row).to_contain_text(vllm_server.model)
    page.screenshot(path=str(artifacts_dir / "fleet_list.png"), full_page=True)
