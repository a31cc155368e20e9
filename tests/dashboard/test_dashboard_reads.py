"""The dashboard reads well, in a real Chromium at 375 px and 1400 px wide.

Real job histories first: `worker.runner.run_claimed_job` runs four jobs through the real engine on
the CPU tiny models and a real SQLite database, as a worker would (tests/engine/recipe_helpers.py
builds `tiny-pretrained`, a small model whose loss can go wrong):
- `warned`: overfitting and memorizing warnings (it relearns answers it knew), succeeds;
- `diverged`: learning rate x100, fails with code `diverged` after a few steps;
- `broken`: a file with bad lines, fails before any step;
- `flat`: learning rate x1e-6 on tiny-llama, "nothing trained".
Then the API serves them (uvicorn in a thread) and the browser checks what a reader needs: the
error once at the top and no empty charts, the per-step lines folded, health badges on the job,
the list and the chart, the suffix/duration/model columns (every one in view, for the widest row
too), the metrics CSV and checkpoints (their Download buttons in view), the last loss drawn over
the smoothed line, the x-axis switch, and no page wider than the screen. Screenshots of every page
at both sizes go to test-artifacts/ (dashboard-<page>-<width>.png).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.test_browser import CHROMIUM_ARGS, OUT_OF_VIEW, last_loss_shown, out_of_view
from tests.e2e.datasets import broken_lines
from tests.engine.recipe_helpers import ANIMALS, build_pretrained_tiny, write_animal_chats
from tests.live_server import serve
from tests.servers import require_binary
from tests.worker.conftest import WorkerEnv, worker_env  # noqa: F401
from worker import runner

pytestmark = [pytest.mark.browser, pytest.mark.timeout(900)]

WIDTHS = (375, 1400)
# A jobs-table row as wide as they come: a long hub id, a long suffix, three badges, six-digit
# numbers; rendered by the page's own `row()`, added to the table and measured in one go (the
# table is redrawn every second).
WIDEST_JOB = {
    "id": "ftjob-" + "W" * 24, "status": "running", "model": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "suffix": "a-long-suffix-for-ui", "error_code": None, "step": 123456, "total_steps": 999999,
    "warnings": [{"health": h, "step": 1} for h in ("overfitting", "memorizing", "not_training")],
    "train_loss": 0.0123456, "tokens_per_s": 123456.7, "eta_seconds": 86399.0,
    "created_at": 0, "started_at": 0, "finished_at": None, "result_files": [],
}  # fmt: skip
WIDEST_ROW_OUT_OF_VIEW = f"""(job) => {{
  document.querySelector('#jobs tbody').insertAdjacentHTML('beforeend', row(job));
  return ({OUT_OF_VIEW})('#jobs th, #jobs td');
}}"""


@dataclass
class Dashboard:
    url: str
    key: str
    jobs: dict[str, str]  # name -> job id


def chats(pairs: list[tuple[str, str]]) -> bytes:
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs
    ]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture
def dashboard(
    worker_env: WorkerEnv,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Dashboard]:
    from service.app import create_app
    from service.auth import create_key
    from service.db.session import session_scope
    from service.settings import get_settings
    from tests.servers import shared_redis_url

    monkeypatch.setenv("LORAQ_REDIS_URL", shared_redis_url())  # the Workers page reads its registry
    monkeypatch.setenv("LORAQ_REAPER_INTERVAL_SECONDS", "0")
    get_settings.cache_clear()

    build_pretrained_tiny(get_settings().model_store, tmp_path)
    animals = worker_env.upload(
        write_animal_chats(tmp_path / "animals.jsonl", 8).read_bytes(), "animals.jsonl"
    )
    plants = worker_env.upload(
        chats([(f"what is the {a}?", f"the {a} is a plant.") for a in ANIMALS * 4]), "plants.jsonl"
    )
    a32 = worker_env.upload(write_animal_chats(tmp_path / "a32.jsonl", 32).read_bytes())
    pretrained = {"model": "tiny-pretrained", "lora": {"r": 8, "alpha": 16}, "seed": 3}

    def hp(epochs: int, lr_multiplier: float) -> dict[str, Any]:
        return {"n_epochs": epochs, "batch_size": 4, "learning_rate_multiplier": lr_multiplier}

    specs: dict[str, dict[str, Any]] = {
        "warned": dict(pretrained, training_file=plants, validation_file=animals, suffix="relearn",
                       hyperparameters=hp(4, 25.0)),
        "diverged": dict(pretrained, training_file=a32, suffix="too-hot", hyperparameters=hp(3, 100.0)),
        "broken": {"training_file": worker_env.upload(broken_lines()), "suffix": "broken"},
        "flat": {"training_file": animals, "suffix": "cold", "hyperparameters": hp(12, 1e-6)},
    }  # fmt: skip
    ids = {}
    for name, spec in specs.items():
        ids[name] = worker_env.create_job(spec["training_file"], **spec)
        runner.run_claimed_job(ids[name])
    with session_scope() as s:
        key = create_key(s, "worker-tests")
    with serve(create_app()) as url:
        yield Dashboard(url=url, key=key, jobs=ids)


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium = require_binary("chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_page(browser: Any, dash: Dashboard, width: int) -> tuple[Any, Any, list[str]]:
    context = browser.new_context(viewport={"width": width, "height": 900}, accept_downloads=True)
    context.add_init_script(f"localStorage.setItem('loraq.apiKey', {json.dumps(dash.key)})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    return context, page, errors


def fits(page: Any) -> None:
    """Nothing sticks out sideways: wide tables scroll inside their own box."""
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    culprits = page.evaluate(
        """[...document.querySelectorAll('body *')]
        .filter((e) => e.getBoundingClientRect().right > window.innerWidth + 1)
        .slice(0, 5).map((e) => `${e.tagName}#${e.id}.${e.className}`)"""
    )
    assert overflow <= 0, f"page is {overflow} px wider than the screen: {culprits}"


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_dashboard_reads_well_at_375_and_1400(
    dashboard: Dashboard, browser: Any, artifacts_dir: Path, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    d = dashboard
    for width in WIDTHS:
        context, page, errors = open_page(browser, d, width)

        # The job list: suffix, duration and model columns; badges on the jobs that went wrong.
        page.goto(d.url + "/")
        warned_row = page.locator(f'#jobs tr[data-job-id="{d.jobs["warned"]}"]')
        expect(warned_row).to_have_attribute("data-status", "succeeded")
        headers = page.locator("#jobs thead th").all_inner_texts()
        assert {"SUFFIX", "DURATION", "MODEL"} <= {h.strip().upper() for h in headers if h.strip()}
        expect(warned_row.locator(".suffix")).to_have_text("relearn")
        expect(warned_row.locator(".duration")).to_have_text(re.compile(r"^(\d+m )?\d+s$"))
        expect(warned_row.locator('[data-health="overfitting"]')).to_be_visible()
        expect(warned_row.locator('[data-health="memorizing"]')).to_be_visible()
        diverged_row = page.locator(f'#jobs tr[data-job-id="{d.jobs["diverged"]}"]')
        expect(diverged_row.locator('[data-health="diverged"]')).to_be_visible()
        flat_row = page.locator(f'#jobs tr[data-job-id="{d.jobs["flat"]}"]')
        expect(flat_row.locator('[data-health="not_training"]')).to_be_visible()
        fits(page)
        # No column is cut (at 1400 px the table needs no sideways scroll), the widest row's neither.
        assert out_of_view(page, "#jobs th, #jobs td") == []
        cut = page.evaluate(WIDEST_ROW_OUT_OF_VIEW, WIDEST_JOB)
        assert cut == [], "\n".join(cut)
        page.screenshot(path=str(artifacts_dir / f"dashboard-jobs-{width}.png"), full_page=True)

        # A failed job with no step: its error once, at the top; no empty charts.
        page.goto(f"{d.url}/jobs/{d.jobs['broken']}")
        expect(page.locator("body")).to_have_attribute("data-final", "true")
        error = page.locator("#joberror")
        expect(error).to_be_visible()
        expect(error).to_contain_text("invalid_training_file")
        message = page.evaluate("document.getElementById('joberror').textContent").split(": ", 1)[1]
        assert page.evaluate("document.body.innerText").count(message[:60]) == 1
        expect(page.locator("#charts")).to_be_hidden()
        expect(page.locator("#nocharts")).to_contain_text("No training step ran")
        fits(page)
        page.screenshot(path=str(artifacts_dir / f"dashboard-failed-{width}.png"), full_page=True)

        # A diverged job: the error with its hint once, the badge, the steps it ran on the chart.
        page.goto(f"{d.url}/jobs/{d.jobs['diverged']}")
        expect(page.locator("body")).to_have_attribute("data-final", "true")
        expect(page.locator("#joberror")).to_contain_text("diverged: training diverged at step")
        expect(page.locator("#joberror")).to_contain_text("lower the learning rate")
        expect(page.locator('#badges [data-health="diverged"]')).to_be_visible()
        expect(page.locator("#charts")).to_be_visible()
        assert page.evaluate("document.body.innerText").count("lower the learning rate") == 1
        # the step that blew up is the chart's last point, marked there
        losses = page.evaluate("window.loraqCharts.loss.data[1]")
        assert losses[-1] > 3 * losses[0]
        assert page.evaluate("chartMarks()") == [{"health": "diverged", "step": len(losses)}]
        fits(page)
        page.screenshot(path=str(artifacts_dir / f"dashboard-diverged-{width}.png"), full_page=True)

        # The warned job: badges on the job and the chart, folded events, CSV, checkpoints, x-axes.
        page.goto(f"{d.url}/jobs/{d.jobs['warned']}")
        expect(page.locator("body")).to_have_attribute("data-final", "true")
        for kind in ("overfitting", "memorizing"):
            expect(page.locator(f'#badges [data-health="{kind}"]')).to_be_visible()
            expect(page.locator(f'#healthnotes [data-health="{kind}"]')).to_contain_text("at step")
            expect(page.locator(f'#events [data-health="{kind}"]')).to_be_visible()
        expect(page.locator("#events .folded").first).to_contain_text("per-step line")
        assert page.locator("#events .folded").count() <= 3  # steps and checkpoints fold together
        assert page.locator("#events .folded").count() >= 1
        expect(page.locator("#events")).to_contain_text("successfully completed")
        steps = page.evaluate("window.loraqCharts.loss.data[0]")
        assert steps == list(range(1, len(steps) + 1)) and len(steps) == 32
        page.check("#showsteps")
        assert page.locator("#events .folded").count() == 0
        page.uncheck("#showsteps")
        page.select_option("#xaxis", "tokens")
        tokens = page.evaluate("window.loraqCharts.loss.data[0]")
        assert len(tokens) == 32 and all(b > a for a, b in itertools.pairwise(tokens))
        job = page.evaluate(f"loraq.json('/v1/fine_tuning/jobs/{d.jobs['warned']}')")
        assert tokens[-1] == job["trained_tokens"]
        page.select_option("#xaxis", "time")
        times = page.evaluate("window.loraqCharts.lr.data[0]")
        assert len(times) == 32 and all(b > a for a, b in itertools.pairwise(times))
        page.select_option("#xaxis", "step")
        expect(page.locator("#checkpoints-link")).to_contain_text("Checkpoints (")
        expect(page.locator("#checkpoints button[data-checkpoint]").first).to_be_attached()
        assert out_of_view(page, "#checkpoints button[data-checkpoint]") == []
        # 32 steps are smoothed; the last raw loss is still drawn on top, in view.
        last = last_loss_shown(page)
        assert len(last["smoothed"]) == 32 and None not in last["smoothed"]
        expect(page.locator("#smoothing-note")).to_be_hidden()
        with page.expect_download() as dl:
            page.click("#download-csv")
        csv_lines = Path(dl.value.path()).read_text().splitlines()
        assert csv_lines[0].startswith("step,train_loss") and len(csv_lines) == 33
        fits(page)
        page.screenshot(path=str(artifacts_dir / f"dashboard-job-{width}.png"), full_page=True)

        for name in ("new", "workers"):
            page.goto(f"{d.url}/{name}")
            page.wait_for_load_state("networkidle")
            fits(page)
            page.screenshot(path=str(artifacts_dir / f"dashboard-{name}-{width}.png"), full_page=True)
        context.close()
        assert not errors, f"JavaScript errors at {width} px: {errors}"
