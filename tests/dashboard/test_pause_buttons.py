"""The job page's Pause and Resume buttons (beside Cancel) in a real Chromium, against the app on a
real HTTP server; the worker's side through the state machine (tests/worker/test_pause.py runs a
real one). A queued job pauses at once; a running one shows "Pausing…" until its worker stops it
with a checkpoint; Resume queues it again. At 375 and 1360 px, nothing wider than the screen."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service import jobs
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient
from tests.dashboard.conftest import keyed_page
from tests.dashboard.test_browser import CHROMIUM_ARGS
from tests.dashboard.test_dashboard_reads import fits
from tests.live_server import serve
from tests.servers import require_binary
from tests.service.test_jobs_state import step

pytestmark = pytest.mark.browser


@pytest.fixture
def served(api: ApiClient) -> Iterator[str]:
    from service.app import create_app

    with serve(create_app()) as url:
        yield url


def status(page: Any, expected: str) -> None:
    from playwright.sync_api import expect

    expect(page.locator("#status")).to_have_attribute("data-status", expected, timeout=10_000)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_pause_and_resume_from_the_job_page(served: str, api: ApiClient, artifacts_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    file_id = api.upload(DATASET)
    chromium = require_binary("chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        for width in (1360, 375):
            job_id = api.create_job(file_id)["id"]
            with keyed_page(browser, api.key, width) as (page, errors):
                page.goto(f"{served}/jobs/{job_id}")
                pause, resume = page.locator("#pause"), page.locator("#resume")

                # queued: paused at once, then resumed
                status(page, "queued")
                expect(resume).to_be_hidden()
                pause.click()
                status(page, "paused")
                expect(pause).to_be_hidden()
                expect(page.locator("#cancel")).to_be_visible()
                fits(page)
                resume.click()
                status(page, "queued")

                # running: "Pausing…" until the worker stops at a step with its checkpoint
                with session_scope() as s:
                    claim = jobs.claim(s, job_id=job_id, worker_id="test-worker")
                assert claim is not None
                with session_scope() as s:
                    jobs.record_metrics(s, claim=claim, rows=[step(1), step(2)])
                status(page, "running")
                expect(pause).to_have_text("Pause")
                pause.click()
                expect(pause).to_have_text("Pausing…")
                expect(pause).to_be_disabled()
                expect(resume).to_be_visible()  # a pause not reached yet can be withdrawn
                assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["pause_requested"] is True
                fits(page)
                page.screenshot(path=str(artifacts_dir / f"dashboard-pausing-{width}.png"), full_page=True)
                with session_scope() as s:
                    assert jobs.pause(s, claim=claim, step=2)
                status(page, "paused")
                expect(page.locator("#events")).to_contain_text("Fine-tuning job paused at step 2")
                expect(resume).to_be_visible()
                page.screenshot(path=str(artifacts_dir / f"dashboard-paused-{width}.png"), full_page=True)
                resume.click()
                status(page, "queued")
                expect(page.locator("#events")).to_contain_text("Fine-tuning job resumed from step 0")
                expect(pause).to_be_visible()
                assert not errors, errors
        browser.close()
