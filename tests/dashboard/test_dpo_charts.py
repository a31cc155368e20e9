"""A DPO job's own curves (issue 33, point 3): its steps' rewards, margin, accuracy and chosen
answers' NLL per token are stored with the step (job_metrics, migrations 0010 and 0012), served by
the dashboard's metrics API and the job's metrics events, and drawn on the job page beside the
loss; a supervised job's page has no DPO charts. The app on a real HTTP server in a real
Chromium; the worker's side through the state machine (tests/engine/test_dpo.py runs the engine)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service import jobs
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient, job_body
from tests.dashboard.conftest import keyed_page
from tests.dashboard.test_browser import CHROMIUM_ARGS
from tests.dashboard.test_dashboard_reads import fits
from tests.live_server import serve
from tests.servers import require_binary
from tests.service.test_api_dpo import PAIRS
from tests.service.test_jobs_state import step
from worker.engine.types import PreferenceMetrics, StepMetrics

pytestmark = pytest.mark.browser


@pytest.fixture
def served(api: ApiClient) -> Iterator[str]:
    from service.app import create_app

    with serve(create_app()) as url:
        yield url


def dpo_step(n: int) -> StepMetrics:
    """Step n of a DPO run whose chosen reward rises, rejected one falls and chosen NLL falls;
    validated at step 3."""
    readings = PreferenceMetrics(0.1 * n, -0.1 * n, 0.2 * n, min(1.0, 0.3 * n), chosen_nll=2.0 - 0.25 * n)
    valid = PreferenceMetrics(0.05, -0.05, 0.1, 0.75, chosen_nll=1.5) if n == 3 else None
    return dataclasses.replace(
        step(n, total=4, loss=0.69 - 0.05 * n),
        valid_loss=0.6 if n == 3 else None,
        preference=readings,
        valid_preference=valid,
    )


def running_job(api: ApiClient, data: bytes, rows: list[StepMetrics], **spec: Any) -> str:
    file_id = api.upload(data)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, **spec))
    assert r.status_code == 200, r.text
    job_id: str = r.json()["id"]
    with session_scope() as s:
        claim = jobs.claim(s, job_id=job_id, worker_id="test-worker")
    assert claim is not None
    with session_scope() as s:
        jobs.record_metrics(s, claim=claim, rows=rows)
    return job_id


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_dpo_job_page_draws_rewards_and_accuracy(served: str, api: ApiClient, artifacts_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    dpo = running_job(
        api, PAIRS, [dpo_step(n) for n in (1, 2, 3)], method={"type": "dpo"}, hyperparameters=None
    )
    sft = running_job(api, DATASET, [step(1), step(2)])
    stored = api.get(f"/dashboard/api/jobs/{dpo}/metrics").json()["data"]
    assert [r["reward_margin"] for r in stored] == pytest.approx([0.2, 0.4, 0.6])
    assert [r["valid_reward_accuracy"] for r in stored] == [None, None, 0.75]
    assert [r["chosen_nll"] for r in stored] == pytest.approx([1.75, 1.5, 1.25])
    assert [r["valid_chosen_nll"] for r in stored] == [None, None, 1.5]
    events = api.get(f"/v1/fine_tuning/jobs/{dpo}/events", params={"limit": 50}).json()["data"]
    metrics = [e["data"] for e in events if e["type"] == "metrics"]
    assert sorted(m["reward_accuracy"] for m in metrics) == pytest.approx([0.3, 0.6, 0.9])
    assert sorted(m["chosen_nll"] for m in metrics) == pytest.approx([1.25, 1.5, 1.75])

    chromium = require_binary("chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        for width in (1360, 375):
            with keyed_page(browser, api.key, width) as (page, errors):
                page.goto(f"{served}/jobs/{dpo}")
                expect(page.locator("#dpocharts")).to_be_visible(timeout=10_000)
                page.wait_for_function(
                    "() => window.loraqCharts.reward && window.loraqCharts.reward.data[0].length === 3"
                )
                reward = page.evaluate("window.loraqCharts.reward.data")
                assert reward[0] == [1, 2, 3]
                assert reward[1] == pytest.approx([0.1, 0.2, 0.3]) and reward[2] == pytest.approx(
                    [-0.1, -0.2, -0.3]
                )
                assert reward[4] == [None, None, 0.1]  # the validation margin where a pass ran
                assert reward[5] == pytest.approx([1.75, 1.5, 1.25]) and reward[6] == [None, None, 1.5]
                labels = page.evaluate("window.loraqCharts.reward.series.map((s) => [s.label, s.scale])")
                assert labels[5:] == [["chosen NLL / token", "nll"], ["validation chosen NLL / token", "nll"]]
                acc = page.evaluate("window.loraqCharts.acc.data")
                assert acc[1] == pytest.approx([0.3, 0.6, 0.9]) and acc[2] == [None, None, 0.75]
                fits(page)
                page.screenshot(path=str(artifacts_dir / f"dashboard-dpo-{width}.png"), full_page=True)
                page.goto(f"{served}/jobs/{sft}")
                page.wait_for_function(
                    "() => window.loraqCharts.loss && window.loraqCharts.loss.data[0].length === 2"
                )
                expect(page.locator("#dpocharts")).to_be_hidden()
                assert errors == []
        browser.close()
