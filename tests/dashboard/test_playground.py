"""The dashboard's issue-14 pages in a real Chromium against the real stack (API, Celery worker,
`loraq inference`): the Playground on a succeeded job (base and fine-tuned answers side by side,
streamed, a checkpoint picked), the eval_prompts samples per checkpoint, Compare runs from the
jobs list (overlaid loss curves, differing hyperparameters highlighted, the table inside its card
at 1400 px), and the New-job page: every training field (the Advanced ones built from the API's
schema), its dry run and the server's 400 naming a field, and the model list's labels.
Screenshots go to test-artifacts/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.test_browser import JOB_TIMEOUT_MS, api, jsonl, page  # noqa: F401 - fixture
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service
from worker.engine.training_config import Placement, TrainingOptions

pytestmark = pytest.mark.browser

EVAL_PROMPTS = ["What do bees make?", "Name a primary colour."]
# The training fields the New-job page has its own controls for; the rest are its Advanced fields.
BASIC_FIELDS = {"lora", "max_seq_len", "seed", "eval_prompts", "queue"}
# Advanced fields the test sets (as typed on the page, then as the job must carry them).
ADVANCED = {
    "packing": ("false", False),
    "lr_scheduler": ("linear", "linear"),
    "warmup_ratio": ("0.1", 0.1),
    "weight_decay": ("0.01", 0.01),
    "grad_accum": ("2", 2),
    "max_grad_norm": ("0.5", 0.5),
    "eval_every": ("3", 3),
    "checkpoint_every": ("2", 2),
    "validation_split": ("0.2", 0.2),
}


def chat(svc: Service, model: str, prompt: str, max_tokens: int) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    return str(api(svc, "POST", "/v1/chat/completions", json=body)["choices"][0]["message"]["content"])


def test_playground_samples_and_compare(
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


def test_new_job_page_sets_every_training_field(
    stack: Service,
    page: Any,  # noqa: F811 - the fixture imported above
    artifacts_dir: Path,
) -> None:
    from playwright.sync_api import expect

    svc = stack
    svc.start_inference()  # a dry run's files are tokenized by an inference worker
    page.add_init_script(f"localStorage.setItem('loraq.apiKey', {svc.key!r})")
    page.goto(svc.url + "/new")

    # 1. A model that is not local says what its job would do: with auto-pull (this stack's
    # default) it downloads it; with LORAQ_AUTO_PULL=0 (the server's listing says so,
    # tests/service/test_models_local.py) the job is refused until `loraq models pull`.
    smollm2 = page.locator("#model option[value='smollm2-135m-instruct']")
    expect(smollm2).to_have_text(
        "smollm2-135m-instruct (Llama, 135M parameters, context 8192; not local: downloaded on first use)"
    )
    page.route("**/v1/models", lambda route: route.fulfill(json=no_auto_pull(route.fetch().json())))
    page.reload()
    expect(smollm2).to_have_text(
        "smollm2-135m-instruct (Llama, 135M parameters, context 8192; "
        "not local: run `loraq models pull` first)"
    )
    page.unroute("**/v1/models")
    page.reload()

    # 2. The Advanced section (collapsed) holds every other training field, described by the schema.
    advanced = page.locator("#advanced")
    expect(advanced).to_have_attribute("data-loaded", "true", timeout=30_000)
    assert advanced.evaluate("d => d.open") is False
    rendered = page.locator("#advancedfields label").evaluate_all("ls => ls.map((l) => l.dataset.field)")
    assert set(rendered) == (set(TrainingOptions.model_fields) | set(Placement.model_fields)) - BASIC_FIELDS
    warmup = page.locator('#advancedfields label[data-field="warmup_ratio"]')
    expect(warmup).to_contain_text(f"[0, 1) · {TrainingOptions.model_fields['warmup_ratio'].description}")
    expect(page.locator("#warmup_ratio")).to_have_attribute("placeholder", "default: 0")
    expect(page.locator("#grad_accum")).to_have_attribute("max", "4096")
    expect(page.locator("#n_epochs")).to_have_attribute("max", "1000")  # the basic fields' bounds too

    # 3. Every field set; the dry run sends them all (packing changes its steps).
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
    page.click("#advanced summary")
    for name, (typed, _) in ADVANCED.items():
        if page.locator(f"#{name}").evaluate("el => el.tagName") == "SELECT":
            page.select_option(f"#{name}", typed)
        else:
            page.fill(f"#{name}", typed)
    with page.expect_request(lambda r: r.method == "POST" and r.url.endswith("/v1/fine_tuning/jobs")) as dry:
        page.click("#dryrun")
    sent_dry = dry.value.post_data_json
    assert sent_dry["dry_run"] is True and {name: sent_dry[name] for name in ADVANCED} == sent(ADVANCED)
    assert "n_gpus" not in sent_dry  # left empty: the server's default
    expect(page.locator("#plan")).to_be_visible(timeout=30_000)
    same = {
        "model": "tiny-llama",
        "training_file": page.evaluate("uploaded.train.file.id"),
        "hyperparameters": {"n_epochs": 3, "batch_size": 4},
        "max_seq_len": 256,
        "dry_run": True,
    }
    steps = api(svc, "POST", "/v1/fine_tuning/jobs", json={**same, **sent(ADVANCED)})["steps"]
    assert steps != api(svc, "POST", "/v1/fine_tuning/jobs", json=same)["steps"]
    expect(page.locator("#plansteps")).to_have_text(str(steps))
    page.screenshot(path=str(artifacts_dir / "dashboard-new-job-dry-run.png"), full_page=True)

    # 4. Out of range: the server's 400 names the field, whose control is marked (Advanced reopened).
    page.fill("#warmup_ratio", "1.5")
    advanced.evaluate("d => { d.open = false; }")
    page.click("#submit")
    expect(page.locator("#submiterror")).to_contain_text("invalid value for 'warmup_ratio'")
    expect(page.locator("#submiterror")).to_contain_text("(warmup_ratio)")
    expect(page.locator("#warmup_ratio")).to_have_attribute("aria-invalid", "true")
    assert advanced.evaluate("d => d.open") is True
    assert page.url.endswith("/new")

    # 5. Submitted: the job carries every field set, and the server's default for those left empty.
    page.fill("#warmup_ratio", "0.1")
    page.click("#submit")
    page.wait_for_url("**/jobs/ftjob-*")
    created = api(svc, "GET", f"/v1/fine_tuning/jobs/{page.url.rstrip('/').split('/')[-1]}")
    assert created["lora"] == {"r": 6, "alpha": 12.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                               "use_rslora": True}  # fmt: skip
    assert created["max_seq_len"] == 256 and created["eval_prompts"] == [
        "Hello?",
        "What is frozen water called?",
    ]
    assert {name: created[name] for name in ADVANCED} == sent(ADVANCED)
    assert created["n_gpus"] == Placement.model_fields["n_gpus"].default  # left empty: not sent


def sent(fields: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    return {name: value for name, (_, value) in fields.items()}


def no_auto_pull(models: dict[str, Any]) -> dict[str, Any]:
    """The model list as a server with LORAQ_AUTO_PULL=0 serves it."""
    # fine-tuned models carry no auto_pull (null): they are never pulled
    data = [m if m["auto_pull"] is None else {**m, "auto_pull": False} for m in models["data"]]
    return {**models, "data": data}
