"""The dashboard's issue-14 pages in a real Chromium against the real stack (API, Celery worker,
`loraq inference`): the Playground on a succeeded job (base and fine-tuned answers side by side,
streamed, a checkpoint picked), the eval_prompts samples per checkpoint, Compare runs from the
jobs list (overlaid loss curves, differing hyperparameters highlighted, the table inside its card
at 1400 px), and the New-job page's LoRA/extension fields and dry run. Screenshots go to
test-artifacts/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.test_browser import JOB_TIMEOUT_MS, api, jsonl, page  # noqa: F401 - fixture
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service

pytestmark = pytest.mark.browser

EVAL_PROMPTS = ["What do bees make?", "Name a primary colour."]


def chat(svc: Service, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return str(api(svc, "POST", "/v1/chat/completions", json=body)["choices"][0]["message"]["content"])


def test_playground_samples_compare_and_new_job_fields(
    stack: Service,
    page: Any,  # noqa: F811 - the fixture imported above
    artifacts_dir: Path,
) -> None:
    from playwright.sync_api import expect

    svc = stack
    svc.start_inference()
    file_id = api(svc, "POST", "/v1/files", data={"purpose": "fine-tune"},
                  files={"file": ("t.jsonl", chat_lines(16))})["id"]  # fmt: skip
    # one example a row: 16 examples in batches of 4 are 4 steps an epoch, a checkpoint every 4
    base = {"model": "tiny-llama", "training_file": file_id, "max_seq_len": 128, "packing": False}
    first = api(svc, "POST", "/v1/fine_tuning/jobs", json={
        **base, "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 10},
        "lora": {"r": 4, "alpha": 8}, "eval_prompts": EVAL_PROMPTS})  # fmt: skip
    second = api(svc, "POST", "/v1/fine_tuning/jobs", json={
        **base, "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 2},
        "lora": {"r": 8, "alpha": 8}})  # fmt: skip
    for job in (first, second):
        svc.wait_job(job["id"], {"succeeded"})
    page.add_init_script(f"localStorage.setItem('loraq.apiKey', {svc.key!r})")

    # 1. eval_prompts: answered at every checkpoint, shown as a prompt x checkpoint table.
    samples = api(svc, "GET", f"/dashboard/api/jobs/{first['id']}/samples")
    assert samples["prompts"] == EVAL_PROMPTS and [c["step"] for c in samples["data"]] == [4, 8]
    assert all(len(c["samples"]) == 2 for c in samples["data"])
    # a sample is what the checkpoint's model answers at temperature 0 (the engine's 48 tokens)
    step4 = f"ft:tiny-llama::{first['id']}:ckpt-step-4"
    assert chat(svc, step4, EVAL_PROMPTS[1], 48) == samples["data"][0]["samples"][1]
    page.goto(f"{svc.url}/jobs/{first['id']}")
    expect(page.locator("#samplescard")).to_be_visible(timeout=30_000)
    for c in samples["data"]:
        cells = page.locator(f'#samples td[data-step="{c["step"]}"]')
        # the tiny random model can emit a NUL, which the table shows as U+FFFD (HTML would drop it)
        expect(cells).to_have_text([s.replace("\x00", "\ufffd") for s in c["samples"]])
    assert page.evaluate("loraq.esc('a\\0<b>')") == "a\ufffd&lt;b&gt;"

    # 2. Playground: a checkpoint against the base, both streamed side by side.
    expect(page.locator("#playground")).to_be_visible(timeout=30_000)
    options = page.locator("#pg-model option")
    expect(options).to_have_count(3)  # final + two checkpoints
    ckpt_model = options.nth(1).get_attribute("value") or ""
    assert ckpt_model.endswith(":ckpt-step-4")
    page.select_option("#pg-model", ckpt_model)
    page.fill("#pg-prompt", "How many legs does a spider have?")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "12")
    page.click("#pg-run")
    expect(page.locator("#pg-base")).to_have_attribute("data-done", "true", timeout=60_000)
    expect(page.locator("#pg-tuned")).to_have_attribute("data-done", "true", timeout=60_000)
    expect(page.locator("#pg-base")).to_have_text(
        chat(svc, "tiny-llama", "How many legs does a spider have?", 12)
    )
    expect(page.locator("#pg-tuned")).to_have_text(
        chat(svc, ckpt_model, "How many legs does a spider have?", 12)
    )
    # the final adapter (trained longest) answers differently from the base
    final = options.nth(0).get_attribute("value") or ""
    assert final == f"ft:tiny-llama::{first['id']}"
    page.select_option("#pg-model", final)
    page.evaluate("document.getElementById('pg-tuned').dataset.done = 'stale'")  # the last run's
    page.click("#pg-run")
    expect(page.locator("#pg-tuned")).to_have_attribute("data-done", "true", timeout=60_000)
    expect(page.locator("#pg-tuned")).to_have_text(chat(svc, final, "How many legs does a spider have?", 12))
    assert page.locator("#pg-base").text_content() != page.locator("#pg-tuned").text_content()
    page.screenshot(path=str(artifacts_dir / "dashboard-playground.png"), full_page=True)

    # 3. The jobs table fits its card at 1400 px; pick both jobs and compare them.
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(svc.url + "/")
    expect(page.locator("#jobs tbody tr")).to_have_count(2, timeout=30_000)
    table = page.locator("#jobs").bounding_box()
    card = page.locator("#jobs").locator("xpath=ancestor::div[contains(@class,'card')]").bounding_box()
    assert table is not None and card is not None
    assert table["x"] + table["width"] <= card["x"] + card["width"], (table, card)
    expect(page.locator("#compare")).to_be_disabled()
    for job in (first, second):
        page.check(f'#jobs input.pick[data-job="{job["id"]}"]')
    page.click("#compare")
    page.wait_for_url("**/compare?ids=*")
    expect(page.locator("body")).to_have_attribute("data-loaded", "true", timeout=30_000)
    labels = page.evaluate("window.loraqCompareChart.series.slice(1).map((s) => s.label)")
    assert sorted(labels) == sorted(
        f"{j['id']} {kind}" for j in (first, second) for kind in ("train", "valid")
    )
    assert page.evaluate("window.loraqCompareChart.data[0].length") == 8  # steps 1..8 of both runs
    differs = page.locator('#comparehp tr[data-differs="true"]')
    expect(differs.filter(has_text="lora.r")).to_have_count(1)
    expect(differs.filter(has_text="hyperparameters.learning_rate_multiplier")).to_have_count(1)
    expect(page.locator('#comparehp tr[data-field="model"]')).to_have_attribute("data-differs", "false")
    page.select_option("#xaxis", "tokens")
    tokens = page.evaluate("window.loraqCompareChart.data[0]")
    assert tokens == sorted(tokens) and tokens[-1] > 8
    page.screenshot(path=str(artifacts_dir / "dashboard-compare.png"), full_page=True)

    # 4. New job: LoRA shape, max_seq_len and eval prompts; a dry run first.
    page.goto(svc.url + "/new")
    expect(page.locator("#model option[value='tiny-llama']")).to_have_count(1)
    page.select_option("#model", "tiny-llama")  # the form defaults to the real smollm2-135m-instruct
    page.set_input_files("#trainfile", jsonl("train.jsonl", chat_lines(10)))
    expect(page.locator('.summary[data-kind="training file"] .examples')).to_have_text("10")
    page.fill("#n_epochs", "3")
    page.fill("#batch_size", "4")
    page.fill("#max_seq_len", "256")
    page.fill("#lora_r", "6")
    page.fill("#lora_alpha", "12")
    page.fill("#lora_target_modules", "q_proj, v_proj")
    page.check("#lora_use_rslora")
    page.fill("#eval_prompts", "Hello?\nWhat is frozen water called?")
    page.click("#dryrun")
    expect(page.locator("#plan")).to_be_visible(timeout=30_000)
    train_id = page.evaluate("uploaded.train.file.id")
    hp = {"n_epochs": 3, "batch_size": 4}
    same = {
        "model": "tiny-llama",
        "training_file": train_id,
        "hyperparameters": hp,
        "max_seq_len": 256,
        "dry_run": True,
    }
    expect(page.locator("#plansteps")).to_have_text(
        str(api(svc, "POST", "/v1/fine_tuning/jobs", json=same)["steps"])
    )
    page.screenshot(path=str(artifacts_dir / "dashboard-new-job-dry-run.png"), full_page=True)
    page.click("#submit")
    page.wait_for_url("**/jobs/ftjob-*")
    created = api(svc, "GET", f"/v1/fine_tuning/jobs/{page.url.rstrip('/').split('/')[-1]}")
    assert created["lora"] == {"r": 6, "alpha": 12.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                               "use_rslora": True}  # fmt: skip
    assert created["max_seq_len"] == 256 and created["eval_prompts"] == [
        "Hello?",
        "What is frozen water called?",
    ]
