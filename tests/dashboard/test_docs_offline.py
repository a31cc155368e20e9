"""/docs and /redoc render in a real Chromium with every request outside the service refused (as on a
machine with no internet): their JS and CSS come from the service, and their Content-Security-Policy
(service/api/security_headers.py, DOCS_CSP) blocks nothing they use, ReDoc's search worker included.
/favicon.ico answers an icon.

One request is let through unanswered: ReDoc's "API docs by Redocly" attribution logo, which its
bundle always asks of its CDN and hides when that fails (`onError`), as it does offline; the CSP
(`img-src 'self' data:`) refuses it first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard.test_browser import CHROMIUM_ARGS
from tests.live_server import serve
from tests.servers import require_binary

pytestmark = pytest.mark.browser

# ReDoc's attribution image: decorative, hidden by ReDoc when it cannot load
REDOC_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


@pytest.fixture
def docs_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from service.app import create_app
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("LORAQ_REAPER_INTERVAL_SECONDS", "0")
    get_settings.cache_clear()
    try:
        with serve(create_app()) as url:
            yield url
    finally:
        get_settings.cache_clear()


def test_favicon_and_assets_are_local(docs_url: str) -> None:
    icon = httpx.get(docs_url + "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
    assert icon.content[:4] == b"\x00\x00\x01\x00"  # an ICO header
    for page in ("/docs", "/redoc"):
        html = httpx.get(docs_url + page).text
        assert "cdn" not in html.lower() and "http" not in html.replace("http-equiv", "")
        assert "<script>" not in html  # no inline script: a CSP of 'self' holds


def test_docs_render_offline(docs_url: str, artifacts_dir: Path) -> None:
    chromium = require_binary("chromium")
    from playwright.sync_api import expect, sync_playwright

    outside: list[str] = []

    def only_local(route: Any) -> None:
        if route.request.url.startswith(docs_url):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # a script, style or worker the pages' Content-Security-Policy blocks is a console error only
        page.on(
            "console",
            lambda m: (
                errors.append(m.text) if m.type == "error" and "Content Security Policy" in m.text else None
            ),
        )
        page.route("**/*", only_local)

        page.goto(docs_url + "/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("Loraq", timeout=20_000)
        expect(page.locator(".opblock-tag-section").first).to_be_visible()
        page.screenshot(path=str(artifacts_dir / "docs-swagger.png"))

        page.goto(docs_url + "/redoc")
        expect(page.locator("h1").first).to_contain_text("Loraq", timeout=20_000)
        page.locator("input[placeholder='Search...']").fill("jobs")  # ReDoc's search runs in a worker
        expect(page.locator("[role='search'] li").first).to_be_visible(timeout=20_000)
        page.screenshot(path=str(artifacts_dir / "docs-redoc.png"))
        browser.close()
    assert [e for e in errors if REDOC_LOGO not in e] == [], errors  # the CSP keeps the logo off the CDN
    assert [u for u in outside if u != REDOC_LOGO] == [], f"requests left the service: {outside}"
