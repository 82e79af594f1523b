"""The browser tests' chromium (Debian's, the agreed flags) as a `page` fixture, and their shared constants."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# A probe of the CPU vLLM (models, tokenize, scoring, a short streamed generation) takes a few seconds;
# the queue, the worker and the 1.5 s polling add a little. 120 s leaves room on a loaded 2-core machine.
READY_TIMEOUT_MS = 120_000
PASSWORD = "pw-browser-123456"


@pytest.fixture
def page(live_server, artifacts_dir: Path):
    # Playwright's sync API runs an event loop in this thread; Django's ORM calls made by the test (and the
    # live_server thread) are still plain synchronous calls.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        # No CDN: any request that leaves the live server is refused and fails the test.
        outside: list[str] = []

        def only_live_server(route) -> None:
            if route.request.url.startswith(live_server.url):
                route.continue_()
            else:
                outside.append(route.request.url)
                route.abort()

        context.route("**/*", only_live_server)
        page = context.new_page()
        page.set_default_timeout(15_000)
        try:
            yield page
            assert not outside, f"the pages fetched from outside the server: {outside}"
        finally:
            context.close()
            browser.close()
