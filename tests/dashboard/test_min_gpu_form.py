"""The New-job form says, under the base model, the smallest common GPU that base trains on in the
precision chosen (Advanced: quantization; unset = bf16), as /v1/models' `min_gpu` says it (whose
figures tests/service/test_models_min_gpu.py checks against the memory plan); its dry run shows each
worker class's planned peak and how the plan gets there. A real Chromium; the app on a real HTTP
server, and the real stack (tests/dashboard/stack.py) for the dry run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ApiClient
from tests.dashboard.conftest import keyed_page
from tests.dashboard.test_browser import CHROMIUM_ARGS, jsonl, page  # noqa: F401
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service
from tests.live_server import serve
from tests.servers import require_binary

pytestmark = pytest.mark.browser
JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture
def served(api: ApiClient) -> Iterator[str]:
    from service.app import create_app

    with serve(create_app()) as url:
        yield url


def expected_note(entry: dict[str, Any], precision: str) -> str:
    """The note's first sentence, from the /v1/models entry."""
    gpu = entry["min_gpu"][precision]["gpu"]
    return f"Smallest GPU in {precision} (default settings): {gpu}, predicted peak"


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_form_names_the_smallest_gpu_of_the_chosen_model_and_precision(
    served: str, api: ApiClient, artifacts_dir: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    listed = {m["id"]: m for m in api.get("/v1/models").json()["data"]}
    eight = listed["llama-8b"]
    # the figures differ between precisions, so the note shows which one it follows
    assert eight["min_gpu_memory_gb"]["bf16"] != eight["min_gpu_memory_gb"]["nf4"]

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=require_binary("chromium"), args=CHROMIUM_ARGS)
        with keyed_page(browser, api.key, 1360) as (page, errors):
            page.goto(f"{served}/new")
            note = page.locator("#mingpu")
            smol = listed["smollm2-135m-instruct"]  # the form's default model
            expect(note).to_contain_text(expected_note(smol, "bf16"))

            page.select_option("#model", "llama-8b")
            expect(note).to_contain_text(expected_note(eight, "bf16"))
            expect(note).to_have_attribute("data-memory-gb", str(eight["min_gpu_memory_gb"]["bf16"]))
            expect(note).to_contain_text(f"nf4: {eight['min_gpu_memory_gb']['nf4']} GB")

            expect(page.locator("#advanced")).to_have_attribute("data-loaded", "true")
            page.click("#advanced summary")
            page.select_option("#quantization", "nf4")
            expect(note).to_contain_text(expected_note(eight, "nf4"))
            expect(note).to_have_attribute("data-memory-gb", str(eight["min_gpu_memory_gb"]["nf4"]))
            expect(note).to_contain_text(f"bf16: {eight['min_gpu_memory_gb']['bf16']} GB")

            page.select_option("#quantization", "gguf")  # a GGUF base's own blocks: not llama-8b
            expect(note).to_have_text("gguf: only for a GGUF base")
            page.select_option("#model", "smollm2-135m-instruct")
            expect(note).to_contain_text(expected_note(smol, "gguf"))

            page.fill("#hub_model", "someone/unknown-model")  # a Hub id no submit has fetched yet
            expect(note).to_contain_text("known once its config.json is fetched")
            page.fill("#hub_model", "")
            page.screenshot(path=str(artifacts_dir / "new-job-min-gpu.png"), full_page=False)
            assert errors == []


@pytest.mark.slow
def test_the_dry_run_shows_each_classs_planned_peak(stack: Service, page: Any) -> None:  # noqa: F811
    from playwright.sync_api import expect

    svc = stack
    svc.start_inference()  # a dry run tokenizes on the inference worker
    page.context.add_init_script(f"localStorage.setItem('loraq.apiKey', {json.dumps(svc.key)})")
    page.goto(svc.url + "/new")
    page.set_input_files("#trainfile", jsonl("train.jsonl", chat_lines(16)))
    expect(page.locator('.summary[data-kind="training file"] .examples')).to_have_text("16")
    page.select_option("#model", "llama-1b")  # h100 has a benchmark row of it: a wall time too
    with page.expect_response(lambda r: r.url == svc.url + JOBS and r.request.method == "POST") as sent:
        page.click("#dryrun")
    plan = sent.value.json()
    for e in plan["estimates"]:
        shown = page.locator(f'#plankv .estimate[data-class="{e["worker_class"]}"]')
        if e["memory_plan"] is None:  # a class of unknown GPU: why, and no figure
            expect(shown).not_to_contain_text("GiB peak")
        else:  # the plan's peak and how it gets there (micro-batches, checkpointing)
            expect(shown).to_contain_text(f"GiB peak ({e['memory_plan']['plan']})")
        if e["unavailable"]:
            expect(shown).to_contain_text(e["unavailable"])
    h100 = next(e for e in plan["estimates"] if e["worker_class"] == "h100")
    assert h100["memory_plan"]["fits"] and h100["wall_seconds"] is not None  # both figures shown above
