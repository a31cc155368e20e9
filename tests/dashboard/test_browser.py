"""The dashboard in a real Chromium (Playwright) against the real stack: enter the key, upload a
dataset through the form (a broken one first, to see its bad lines), submit a tiny-llama job,
watch the jobs table reach `succeeded`, check the loss chart has one point per step and shows the
last loss, download the adapter and a checkpoint (also at 375 px), then cancel a second job mid-run
from its page (its Cancel button in view at 375 px), and list the training and inference workers.
Screenshots go to test-artifacts/."""

from __future__ import annotations

import io
import json
import re
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service import worker_registry
from service.cli_models import human_parameters
from tests.e2e.datasets import broken_lines, chat_lines
from tests.e2e.procs import Service
from tests.servers import require_binary
from worker.engine.catalog import TINY_LLAMA_SHAPE

pytestmark = pytest.mark.browser

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
JOB_TIMEOUT_MS = 240_000
PHONE = {"width": 375, "height": 900}
RAW_LOSS_RGB = [0x33, 0x55, 0xDD]  # job.js RAW_COLOR

# Elements of `selector` (shown ones) that stick out of the viewport or, inside a scrolling table
# box, out of that box's visible part: a user would have to scroll sideways to reach them.
OUT_OF_VIEW = """(selector) => [...document.querySelectorAll(selector)]
  .filter((e) => e.getClientRects().length > 0)
  .filter((e) => {
    const r = e.getBoundingClientRect();
    const box = e.closest('.table-wrap, .scroll');
    const b = box ? box.getBoundingClientRect() : { left: 0, right: window.innerWidth };
    return r.left < Math.max(0, b.left) - 1 || r.right > Math.min(window.innerWidth, b.right) + 1;
  })
  .map((e) => {
    const r = e.getBoundingClientRect();
    const at = `${Math.round(r.left)}..${Math.round(r.right)} of ${window.innerWidth}`;
    return `${e.outerHTML.slice(0, 100)} at x ${at}`;
  })"""

# The loss chart's last raw point: its value, where it is on the page and the colour drawn there.
LAST_LOSS = """() => {
  const u = window.loraqCharts.loss;
  const i = u.data[1].length - 1;
  const [x, y] = [u.valToPos(u.data[0][i], 'x'), u.valToPos(u.data[1][i], 'y')];
  const over = u.over.getBoundingClientRect();
  const [cx, cy] = [u.valToPos(u.data[0][i], 'x', true), u.valToPos(u.data[1][i], 'y', true)];
  const rgb = [...u.ctx.getImageData(Math.round(cx), Math.round(cy), 1, 1).data.slice(0, 3)];
  return { loss: u.data[1][i], left: over.left + x, top: over.top + y, inPlot: x >= 0 && x <= over.width
    && y >= 0 && y <= over.height, rgb, smoothed: u.data[2], width: window.innerWidth };
}"""


# The loss chart has been redrawn for the current window width (it fits inside it).
CHART_REDRAWN_TO_FIT = "() => window.loraqCharts.loss.over.getBoundingClientRect().right <= window.innerWidth"


def out_of_view(page: Any, selector: str) -> list[str]:
    found: list[str] = page.evaluate(OUT_OF_VIEW, selector)
    return found


def last_loss_shown(page: Any) -> dict[str, Any]:
    """Checks the last raw loss is drawn in view, on top, in the raw series' colour; returns it."""
    last: dict[str, Any] = page.evaluate(LAST_LOSS)
    assert last["inPlot"] and 0 <= last["left"] <= last["width"], last
    assert last["rgb"] == RAW_LOSS_RGB, f"the last loss is covered: {last['rgb']} drawn there"
    return last


def tick_labels(page: Any, chart: str) -> list[str]:
    """The y-axis tick labels uPlot drew on one of the job page's charts."""
    labels: list[str] = page.evaluate(f"window.loraqCharts.{chart}.axes[1]._values")
    return labels


@pytest.fixture
def page(artifacts_dir: Path) -> Any:
    chromium = require_binary("chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1360, "height": 1000}, accept_downloads=True)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # a script or style the Content-Security-Policy blocks shows up as a console error only
        page.on(
            "console",
            lambda m: (
                errors.append(m.text) if m.type == "error" and "Content Security Policy" in m.text else None
            ),
        )
        yield page
        context.close()
        browser.close()
        assert not errors, f"JavaScript errors on the page: {errors}"


def api(svc: Service, method: str, path: str, **kw: Any) -> Any:
    r = httpx.request(
        method, svc.url + path, headers={"Authorization": f"Bearer {svc.key}"}, timeout=30, **kw
    )
    assert r.is_success, r.text
    return r.json()


def jsonl(name: str, data: bytes) -> dict[str, Any]:
    return {"name": name, "mimeType": "application/jsonl", "buffer": data}


def test_dashboard_end_to_end(stack: Service, page: Any, artifacts_dir: Path, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    svc = stack
    # Pages and assets are public; data is not.
    assert httpx.get(svc.url + "/static/vendor/uplot/uPlot.iife.min.js").status_code == 200
    assert httpx.get(svc.url + "/dashboard/api/jobs").status_code == 401

    # 1. The key is asked for once and kept in localStorage.
    page.goto(svc.url + "/")
    expect(page.locator("#keydialog")).to_be_visible()
    page.fill("#apikey", "sk-wrong")
    page.click("#savekey")
    expect(page.locator("#keyerror")).to_contain_text("not accepted")
    page.fill("#apikey", svc.key)
    page.click("#savekey")
    expect(page.locator("#keydialog")).to_be_hidden()
    assert page.evaluate("localStorage.getItem('loraq.apiKey')") == svc.key

    # 2. New job: a broken file shows its bad lines by number; a good one enables submit.
    page.goto(svc.url + "/new")
    expect(page.locator("#keydialog")).to_be_hidden()
    expect(page.locator("#model option", has_text="tiny-llama")).to_have_count(1)
    # each base with its family, size and context length, and whether it is local
    tiny = TINY_LLAMA_SHAPE
    expect(page.locator("#model option[value='tiny-llama']")).to_have_text(
        f"tiny-llama (Llama, {human_parameters(tiny.parameter_count())} parameters, "
        f"context {tiny.max_position_embeddings}; random weights, tests only; local)"
    )
    expect(page.locator("#model option[value='smollm2-135m-instruct']")).to_contain_text(
        "smollm2-135m-instruct (Llama, 135M parameters, context 8192; "
    )
    expect(page.locator("#model")).to_have_value("smollm2-135m-instruct")  # the real model by default
    # the random-weight presets apart from the real bases, in a group that says what they are for
    random_group = page.locator("#model optgroup[label='Random weights: tests and benchmarks only']")
    expect(random_group.locator("option")).to_have_count(4)  # tiny-llama, llama-1b, llama-8b, smollm2-135m
    expect(
        page.locator("#model optgroup[label='Base models'] option[value='smollm2-135m-instruct']")
    ).to_have_count(1)
    page.set_input_files(
        "#trainfile", {"name": "broken.jsonl", "mimeType": "application/jsonl", "buffer": broken_lines()}
    )
    summary = page.locator('.summary[data-kind="training file"]')
    expect(summary.locator(".badlines")).to_contain_text("line 2: not valid JSON")
    expect(summary.locator(".badlines")).to_contain_text("line 4: format 'prompt_completion' differs")
    expect(summary.locator(".examples")).to_have_text("2")
    expect(page.locator("#submit")).to_be_disabled()
    page.set_input_files(
        "#trainfile", {"name": "train.jsonl", "mimeType": "application/jsonl", "buffer": chat_lines(16)}
    )
    expect(summary.locator(".examples")).to_have_text("16")
    expect(summary.locator(".badcount")).to_have_text("0")
    page.select_option("#model", "tiny-llama")
    page.fill("#n_epochs", "2")
    page.fill("#batch_size", "4")
    page.fill("#learning_rate_multiplier", "5")
    page.fill("#suffix", "browser")
    page.click("#advanced summary")
    page.select_option("#lr_scheduler", "constant")  # a flat learning rate: its axis still has ticks
    page.screenshot(path=str(artifacts_dir / "dashboard-new-job.png"), full_page=True)
    page.click("#submit")
    page.wait_for_url("**/jobs/ftjob-*")
    job_id = page.url.rstrip("/").split("/")[-1]
    svc.start_inference()  # for the Workers page (9.), meanwhile the job runs

    # 3. The jobs table updates live until the job has succeeded.
    page.goto(svc.url + "/")
    row = page.locator(f'#jobs tr[data-job-id="{job_id}"]')
    expect(row).to_have_attribute("data-status", "succeeded", timeout=JOB_TIMEOUT_MS)
    expect(row.locator(".progress-cell")).to_contain_text("/")
    page.screenshot(path=str(artifacts_dir / "dashboard-jobs.png"), full_page=True)
    page.select_option("#statusfilter", "failed")
    expect(row).to_have_count(0)
    page.select_option("#statusfilter", "succeeded")
    expect(row).to_have_count(1)
    assert page.url.endswith("/?status=succeeded")

    # 4. The job page: one loss point per step, the hyperparameters, events, checkpoints.
    row.locator("td.id a").click()
    page.wait_for_url(f"**/jobs/{job_id}")
    expect(page.locator("body")).to_have_attribute("data-final", "true", timeout=30_000)
    progress = api(svc, "GET", f"/dashboard/api/jobs/{job_id}/progress")
    assert progress["status"] == "succeeded" and progress["step"] == progress["total_steps"] > 0
    points = page.evaluate("window.loraqCharts.loss.data[0].length")
    assert points == progress["total_steps"]
    assert page.evaluate("window.loraqCharts.loss.data[0]") == list(range(1, points + 1))
    assert page.evaluate("window.loraqCharts.lr.data[0].length") == points
    expect(page.locator("#losschart")).to_have_attribute("data-points", str(points))
    # A short curve: every raw loss is drawn, none smoothed, and the last one is in view on top.
    assert points < page.evaluate("SMOOTH_MIN_POINTS")
    last = last_loss_shown(page)
    assert last["loss"] == pytest.approx(progress["train_loss"]) and last["smoothed"] == [None] * points
    expect(page.locator("#smoothing-note")).to_be_visible()
    # The flat learning rate's axis: ticks from 0, each label different.
    assert len(set(page.evaluate("window.loraqCharts.lr.data[1]"))) == 1
    lr_ticks = tick_labels(page, "lr")
    assert len(lr_ticks) >= 2 and len(set(lr_ticks)) == len(lr_ticks), lr_ticks
    expect(page.locator("#hyperparameters")).to_contain_text("n_epochs")
    expect(page.locator("#events")).to_contain_text("successfully completed")
    expect(page.locator("#cancel")).to_be_hidden()
    page.screenshot(path=str(artifacts_dir / "dashboard-job.png"), full_page=True)
    # The smoothing control and log scale redraw without errors (page errors fail the test).
    page.fill("#smoothing", "0.9")
    page.dispatch_event("#smoothing", "input")
    expect(page.locator("#smoothing-value")).to_have_text("0.90")
    page.check("#logscale")
    expect(page.locator("#losschart canvas")).to_have_count(1)
    assert page.evaluate("window.loraqCharts.loss.scales.y.distr") == 3  # uPlot's log scale
    assert page.evaluate("window.loraqCharts.loss.data[0].length") == points
    page.screenshot(path=str(artifacts_dir / "dashboard-job-log-smoothed.png"), full_page=True)

    # 5. The adapter download is a PEFT adapter zip.
    with page.expect_download() as dl:
        page.click("#download-adapter")
    adapter = tmp_path / "adapter.zip"
    dl.value.save_as(adapter)
    names = zipfile.ZipFile(io.BytesIO(adapter.read_bytes())).namelist()
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names

    # 6. A checkpoint download: every run registers at least its final checkpoint.
    buttons = page.locator("#checkpoints button[data-checkpoint]")
    expect(buttons.first).to_be_visible()
    with page.expect_download() as dl:
        buttons.first.click()
    assert dl.value.failure() is None
    with zipfile.ZipFile(dl.value.path()) as zf:
        assert "adapter_model.safetensors" in zf.namelist()
    # On a phone every Download button and the last loss stay in view.
    page.set_viewport_size(PHONE)
    expect(buttons.first).to_be_visible()
    assert out_of_view(page, "#checkpoints button[data-checkpoint]") == []
    # the page redraws its charts on the window's resize event, which comes after the new viewport
    page.wait_for_function(CHART_REDRAWN_TO_FIT, timeout=10_000)
    last_loss_shown(page)
    page.screenshot(path=str(artifacts_dir / "dashboard-job-375.png"), full_page=True)
    page.set_viewport_size({"width": 1360, "height": 1000})

    # 7. A second, long job is cancelled mid-run from its page.
    file_id = api(svc, "GET", f"/v1/fine_tuning/jobs/{job_id}")["training_file"]
    body = {"model": "tiny-llama", "training_file": file_id,
            "hyperparameters": {"n_epochs": 500, "batch_size": 4}}  # fmt: skip
    long_job = api(svc, "POST", "/v1/fine_tuning/jobs", json=body)
    svc.wait_job(long_job["id"], {"running"})  # raises with the job's error if it ends instead
    page.goto(f"{svc.url}/jobs/{long_job['id']}")
    expect(page.locator("#status")).to_have_attribute("data-status", "running", timeout=JOB_TIMEOUT_MS)
    # a function, not an expression string: the page's CSP forbids eval, which a string would need
    page.wait_for_function("() => window.loraqCharts.loss.data[0].length >= 3", timeout=JOB_TIMEOUT_MS)
    # The first steps of a long cosine schedule: nearly flat, yet the axis' labels all differ.
    lr_ticks = tick_labels(page, "lr")
    assert len(lr_ticks) >= 2 and len(set(lr_ticks)) == len(lr_ticks), lr_ticks
    # ... as they do for such ticks in the page's own formatter (2.0e-4 three times, before)
    assert page.evaluate("distinctTicks(null, [1.98e-4, 1.99e-4, 2.0e-4])") == [
        "1.98e-4",
        "1.99e-4",
        "2.00e-4",
    ]
    page.set_viewport_size(PHONE)
    expect(page.locator("#cancel")).to_be_visible()
    assert out_of_view(page, "#cancel") == []
    page.set_viewport_size({"width": 1360, "height": 1000})
    # Meanwhile the worker registry names the job this worker runs (the Workers page's data).
    workers = api(svc, "GET", "/dashboard/api/workers")["data"]
    mine = [w for w in workers if w["queue"] == svc.env["LORAQ_WORKER_QUEUE"]]
    assert [w["job"]["job_id"] for w in mine if w["job"]] == [long_job["id"]]
    page.click("#cancel")
    expect(page.locator("#status")).to_have_attribute("data-status", "cancelled", timeout=60_000)
    done = api(svc, "GET", f"/dashboard/api/jobs/{long_job['id']}/progress")
    assert 0 < done["step"] < done["total_steps"]  # stopped mid-run, partial metrics kept
    page.screenshot(path=str(artifacts_dir / "dashboard-cancelled.png"), full_page=True)

    # 8. A job that fails in the worker: its page shows the error. (A file with bad lines or a
    # too-short max_seq_len is refused at submit now; a run planned past the worker's step limit,
    # 16 unpacked examples x 1000 epochs at batch 1, fails before training.)
    refused = httpx.post(svc.url + "/v1/fine_tuning/jobs", json=dict(body, max_seq_len=16),
                         headers={"Authorization": f"Bearer {svc.key}"}, timeout=30)  # fmt: skip
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_seq_len", refused.text
    bad = dict(body, hyperparameters={"n_epochs": 1000, "batch_size": 1}, packing=False)  # 16,000 steps
    failed = api(svc, "POST", "/v1/fine_tuning/jobs", json=bad)
    page.goto(f"{svc.url}/jobs/{failed['id']}")
    expect(page.locator("#status")).to_have_attribute("data-status", "failed", timeout=JOB_TIMEOUT_MS)
    expect(page.locator("#joberror")).to_contain_text("limit_exceeded")
    expect(page.locator("#joberror")).to_contain_text("over the step limit of 5000")
    expect(page.locator("#download-adapter")).to_be_hidden()

    # 9. The Workers page lists our worker (no GPU here, reference kernels), the inference worker,
    # and renders the GPUs of a worker on a GPU host, as its registry entry reports them.
    gpu_node = f"gpuhost-{uuid.uuid4().hex[:6]}:42"
    gpu = {"index": 0, "uuid": "GPU-1", "name": "NVIDIA H100 80GB HBM3", "utilization_percent": 87.0,
           "memory_used_bytes": 10 * 2**30, "memory_total_bytes": 80 * 2**30, "temperature_celsius": 61.0,
           "power_watts": 312.5, "sm_clock_hertz": 1.98e9}  # fmt: skip
    entry = {"node": gpu_node, "queue": "h100", "metrics_port": 9108, "last_seen": time.time(),
             "kernels": {"compiled": True, "reason": "compiled for sm_90"}, "gpus": [gpu]}  # fmt: skip
    rds = redis.Redis.from_url(svc.env["LORAQ_REDIS_URL"])
    rds.set(worker_registry.worker_key(gpu_node), json.dumps(entry), ex=60)
    page.goto(svc.url + "/workers")
    gpu_row = page.locator(f'#workers tbody tr[data-node="{gpu_node}"]')
    expect(gpu_row).to_contain_text("NVIDIA H100 80GB HBM3: 87% util")
    expect(gpu_row).to_contain_text("10.0 GiB / 80.0 GiB, 61 °C, 313 W, 1980 MHz")
    expect(gpu_row.locator(".kernels")).to_have_text("yes")
    expect(gpu_row.locator(".kind")).to_have_text("training")
    # The `loraq inference` worker, by its heartbeat: its id is host:pid of the real process.
    chat_queue = svc.env["LORAQ_INFERENCE_QUEUE"]
    chat_row = page.locator('#workers tbody tr[data-kind="inference"]', has_text=chat_queue)
    expect(chat_row).to_have_count(1)
    expect(chat_row.locator(".node")).to_have_text(re.compile(rf":{svc.procs['inference'].pid}$"))
    expect(chat_row.locator(".kind")).to_have_text("inference")
    expect(chat_row.locator(".job")).to_have_text("serves chat completions")
    # Every column in view, the GPU row's included: in the table at 1400 px, in one block per
    # worker at 375 px.
    for size in ({"width": 1400, "height": 900}, PHONE):
        page.set_viewport_size(size)
        assert out_of_view(page, "#workers th, #workers td") == [], size
        page.screenshot(path=str(artifacts_dir / f"dashboard-workers-{size['width']}.png"), full_page=True)
    rds.delete(worker_registry.worker_key(gpu_node))
    worker_row = page.locator("#workers tbody tr", has_text=svc.env["LORAQ_WORKER_QUEUE"])
    expect(worker_row).to_have_count(1, timeout=15_000)
    expect(worker_row.locator(".kind")).to_have_text("training")
    expect(worker_row.locator(".kernels")).to_contain_text("no: no CUDA device")
    expect(worker_row.locator(".job")).to_contain_text("idle", timeout=15_000)
