"""In Debian's chromium: after 100 mode switches in an hour the endpoint's charts still show their data.

Policy changes are drawn as one trace of small markers (the change on hover) and at most MAX_MODE_BANDS shaded
mode bands (static/js/dashboard.js), never a labelled line per change: the test reads the chart's own data and
layout (Plotly's `.data` and `.layout` on the chart element) and the points drawn in its SVG, before and after
the page refreshes the charts from the timeseries API, and screenshots every view of the page.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from django.utils import timezone

from fleet.models import Endpoint, EndpointStatus
from speculation.models import Action, Mode, PolicyChange
from speculation.services import policies as policy_service
from speculation.services import records
from speculation.web.endpoint_page import VIEWS
from tests.browser.conftest import CHROMIUM, PASSWORD

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]

SWITCHES = 100
DASHBOARD_JS = Path(__file__).resolve().parents[2] / "static" / "js" / "dashboard.js"
MAX_MODE_BANDS = int(re.search(r"MAX_MODE_BANDS = (\d+)", DASHBOARD_JS.read_text()).group(1))
# Plotly (3.5 MB) parses in well under a second alone; on a loaded shared 2-core machine it took over 5 s.
DRAW_TIMEOUT_MS = 30_000
# A view fits a few screens at 1280 px wide; the single page it replaced was about 10,000 px tall.
MAX_VIEW_HEIGHT_PX = 3000

CHART_STATE = """id => {
    const el = document.getElementById(id);
    if (!el || !el.data || !el.layout) return null;
    const named = name => el.data.filter(t => t.name === name);
    const points = name => named(name).reduce((n, t) => n + t.y.filter(y => y !== null).length, 0);
    return {
        shadow: points("shadow"), prod: points("prod"),
        changes: named("policy changes").reduce((n, t) => n + t.x.length, 0),
        shapes: (el.layout.shapes || []).length, annotations: (el.layout.annotations || []).length,
        drawn: el.querySelectorAll(".scatterlayer .trace .points path").length,
    };
}"""


def _endpoint_with_an_hour_of_switching() -> Endpoint:
    endpoint = Endpoint.objects.create(
        name="switchy",
        base_url="http://127.0.0.1:9/",
        status=EndpointStatus.READY,
        capabilities={"tokenizer_fingerprint": "f" * 64, "token_id_prompts": True,
                      "prompt_scoring_method": "prompt_logprobs", "tpot_ms": 20.0},
    )  # fmt: skip
    for i in range(SWITCHES):
        policy_service.update_policy(endpoint=endpoint, mode=Mode.PROD if i % 2 else Mode.SHADOW, path="remote")
    now = timezone.now()
    changes = list(PolicyChange.objects.filter(policy__endpoint=endpoint).order_by("id").values_list("id", flat=True))
    assert len(changes) == SWITCHES
    for i, pk in enumerate(changes):  # one switch every 35 s over the last hour
        PolicyChange.objects.filter(pk=pk).update(changed_at=now - timedelta(minutes=59) + i * timedelta(seconds=35))
    rows = []
    for minute in range(1, 60):  # a record a minute in each mode, through the gateway's batched writes
        for mode, action in ((Mode.SHADOW, Action.WOULD_SPECULATE), (Mode.PROD, Action.SPECULATED)):
            rows.append(
                dict(endpoint_id=endpoint.pk, request_id=f"{mode}-{minute}", mode=mode, action=action,
                     created_at=now - timedelta(minutes=minute), k=4, drafted_tokens=8, accepted_tokens=5,
                     alpha=0.6, multiplier=1.5, tok_s=30.0, baseline_tok_s=20.0)
            )  # fmt: skip
    assert records.write_batch(rows) == len(rows)
    return endpoint


def test_the_charts_stay_readable_after_100_mode_switches_in_an_hour(
    live_server, page, django_user_model, artifacts_dir
):
    from playwright.sync_api import expect

    # given an endpoint switched between shadow and prod 100 times in the last hour, with records in both modes
    django_user_model.objects.create_superuser(username="ops", password=PASSWORD)
    endpoint = _endpoint_with_an_hour_of_switching()
    url = f"{live_server.url}/dashboard/endpoints/{endpoint.pk}/?range=hour"

    # when the operator opens the endpoint page
    page.goto(f"{live_server.url}/login/?next=/dashboard/endpoints/{endpoint.pk}/%3Frange%3Dhour")
    page.fill("#id_username", "ops")
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    expect(page.locator("#chart-acceptance .main-svg").first).to_be_attached(timeout=DRAW_TIMEOUT_MS)

    # then both charts that mark policy changes draw their points, every change as a marker, and few shapes
    def check(stage: str) -> None:
        for chart in ("chart-acceptance", "chart-multiplier"):
            state = page.evaluate(CHART_STATE, chart)
            assert state is not None, (stage, chart)
            assert state["shadow"] >= 30 and state["prod"] >= 30, (stage, chart, state)
            assert state["changes"] == SWITCHES, (stage, chart, state)
            assert state["drawn"] >= state["shadow"] + state["prod"], (stage, chart, state)
            assert state["shapes"] <= MAX_MODE_BANDS and state["annotations"] == 0, (stage, chart, state)

    check("first paint")
    with page.expect_response(lambda r: "/timeseries/" in r.url and "metric=multiplier" in r.url, timeout=20_000):
        pass  # the page refreshes its charts from the API (REFRESH_MS)
    page.wait_for_timeout(500)
    check("after a refresh")

    # and every view is short enough to read, screenshotted in the tests' artifacts
    for name in VIEWS:
        page.goto(url if name == "overview" else f"{url}&view={name}")
        expect(page.locator(f'#endpoint-tabs a[data-view="{name}"]')).to_have_class("active")
        if name == "overview":
            expect(page.locator("#chart-acceptance .main-svg").first).to_be_attached(timeout=DRAW_TIMEOUT_MS)
            page.wait_for_timeout(300)
        height = page.evaluate("document.documentElement.scrollHeight")
        page.screenshot(path=str(artifacts_dir / f"endpoint_view_{name}.png"), full_page=True)
        assert height <= MAX_VIEW_HEIGHT_PX, (name, height)
