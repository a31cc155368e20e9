"""The job page's "Webhook deliveries" panel in a real Chromium: a cancelled job's event, delivered
to a real receiver process on the first attempt, and the same event to an endpoint nobody listens
on, retried (each attempt's error shown, then the next attempt's time); both at 375 and 1360 px,
nothing wider than the screen. A job without deliveries shows no panel."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DATASET, ApiClient
from tests.dashboard.test_browser import CHROMIUM_ARGS
from tests.dashboard.test_dashboard_reads import fits
from tests.live_server import free_port, serve
from tests.servers import require_binary
from tests.service.test_webhook_delivery import receiver, sending, wait_for
from tests.service.test_webhooks import register, settle_outbox

pytestmark = pytest.mark.browser
__all__ = ["sending", "settle_outbox"]  # fixtures


@pytest.fixture
def served(sending: None, api: ApiClient) -> Iterator[str]:
    from service.app import create_app

    with serve(create_app()) as url:
        yield url


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_job_page_lists_each_delivery_and_its_attempts(
    served: str, api: ApiClient, tmp_path: Path, artifacts_dir: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    port, closed = free_port(), free_port()
    listening = register(api, f"http://127.0.0.1:{port}/hook")
    register(api, f"http://127.0.0.1:{closed}/nobody")
    file_id = api.upload(DATASET)
    quiet = api.create_job(file_id)["id"]  # queued, no event
    with receiver(port, listening["secret"], tmp_path):
        job_id = api.create_job(file_id)["id"]
        api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel")
        wait_for(
            lambda: len(api.get(f"/v1/webhook_endpoints/{listening['id']}/deliveries").json()["data"]) == 1,
            "delivered",
        )
        chromium = require_binary("chromium")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            for width in (1360, 375):
                context = browser.new_context(viewport={"width": width, "height": 900})
                context.add_init_script(f"localStorage.setItem('loraq.apiKey', {json.dumps(api.key)})")
                page: Any = context.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto(f"{served}/jobs/{job_id}")
                expect(page.locator("body")).to_have_attribute("data-final", "true")
                rows = page.locator("#webhooks tbody tr")
                expect(rows).to_have_count(2)
                ok = page.locator('#webhooks tr[data-state="delivered"]')
                expect(ok).to_contain_text(f"127.0.0.1:{port}/hook")
                expect(ok).to_contain_text("cancelled")
                expect(ok.locator("ul.attempts li")).to_have_count(1)
                expect(ok.locator("ul.attempts li")).to_contain_text("#1")
                expect(ok.locator("ul.attempts li")).to_contain_text("HTTP 200")
                retried = page.locator('#webhooks tr[data-state="pending"]')
                expect(retried).to_contain_text("/nobody")
                # the panel keeps polling after the job ended: later attempts appear without a reload
                expect(retried.locator("ul.attempts li.failed").nth(1)).to_contain_text("ConnectError")
                # at most the 5 latest attempts, after the count of the earlier ones
                expect(retried.locator("ul.attempts li").first).to_contain_text(
                    "earlier attempt", timeout=10_000
                )
                assert retried.locator("ul.attempts li.failed").count() == 5
                expect(retried.locator("ul.attempts li.muted").last).to_contain_text("next attempt")
                fits(page)
                page.screenshot(path=str(artifacts_dir / f"dashboard-webhooks-{width}.png"), full_page=True)

                page.goto(f"{served}/jobs/{quiet}")
                expect(page.locator("#events")).to_contain_text("Files validated")
                page.wait_for_timeout(500)  # a poll or two more: still no deliveries, no panel
                expect(page.locator("#webhooks-card")).to_be_hidden()
                context.close()
                assert not errors, errors
            browser.close()
    shown: Any = api.get(f"/dashboard/api/jobs/{quiet}/webhook_deliveries").json()
    assert shown == {"object": "list", "data": []}
