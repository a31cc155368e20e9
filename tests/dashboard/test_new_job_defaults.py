"""One set of defaults: the New-job page, untouched, sends only the choices a user must make (the
model and the training file), so its job is the job the API, the `openai` client and the CLI make
from the same choices. Real stack (tests/dashboard/stack.py), real Chromium, real Celery worker.

Compared with what the server itself makes of a request without hyperparameters, never with
numbers written here: what "auto" resolves to is the engine's business."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.dashboard.test_browser import api, jsonl, page  # noqa: F401
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service

# ~45 s on a 2-core box: a stack, an inference worker for the dry runs, three jobs of >= 48 steps
pytestmark = [pytest.mark.browser, pytest.mark.slow]

JOBS = "/v1/fine_tuning/jobs"
# Fields of a job object that differ between two jobs made from the same choices: identity, times,
# the random seed, and what follows from them (outputs, the losses in `progress`).
PER_JOB = {
    "id", "created_at", "started_at", "finished_at", "estimated_finish", "fine_tuned_model",
    "result_files", "seed", "worker_id", "progress",
}  # fmt: skip
# A dry run's fields that are per request: the seed drawn for it, how long its checks took.
PER_PLAN = {"seed", "latency_ms"}


def without(obj: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k not in keys}


def placeholder(prop: dict[str, Any], unset: str) -> str:
    """What an empty field of this schema property says: "auto", the default, or what the server
    does when there is no default (`unset`)."""
    default = prop.get("default")
    if default is None:
        return unset
    if default == "auto":
        return "auto"
    return f"default: {default if isinstance(default, str) else f'{default:g}'}"


def test_untouched_form_makes_the_api_default_job(stack: Service, page: Any) -> None:  # noqa: F811
    from playwright.sync_api import expect

    svc = stack
    svc.start_inference()  # a dry run tokenizes on the inference worker
    page.context.add_init_script(f"localStorage.setItem('loraq.apiKey', {json.dumps(svc.key)})")
    posts: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: posts.append(r.post_data_json) if r.method == "POST" and r.url == svc.url + JOBS else None,
    )
    page.goto(svc.url + "/new")
    expect(page.locator("#advanced")).to_have_attribute("data-loaded", "true")

    # Every field is empty: its placeholder says what the server does (the schema's default).
    schemas = httpx.get(svc.url + "/openapi.json").json()["components"]["schemas"]
    hp, job_create, lora = (schemas[s]["properties"] for s in ("Hyperparameters", "JobCreate", "LoraConfig"))
    fields = {
        "n_epochs": hp["n_epochs"], "batch_size": hp["batch_size"],
        "learning_rate_multiplier": hp["learning_rate_multiplier"], "seed": job_create["seed"],
        "max_seq_len": job_create["max_seq_len"], "lora_r": lora["r"], "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"], "lora_target_modules": lora["target_modules"],
    }  # fmt: skip
    for field, prop in fields.items():
        expect(page.locator(f"#{field}")).to_have_value("")
        unset = "random" if field == "seed" else "server default"
        expect(page.locator(f"#{field}")).to_have_attribute("placeholder", placeholder(prop, unset))
    expect(page.locator("#lora_use_rslora")).to_be_checked(checked=lora["use_rslora"]["default"])

    # The two choices a job needs: a training file (through the form) and the model.
    page.set_input_files("#trainfile", jsonl("train.jsonl", chat_lines(16)))
    expect(page.locator('.summary[data-kind="training file"] .examples')).to_have_text("16")
    page.select_option("#model", "tiny-llama")
    choices = {"model": "tiny-llama", "training_file": page.evaluate("uploaded.train.file.id")}

    # The form's dry run sends the choices alone and shows the plan the API and the CLI make of them.
    with page.expect_response(lambda r: r.url == svc.url + JOBS and r.request.method == "POST") as sent:
        page.click("#dryrun")
    form_plan = sent.value.json()
    assert posts[-1] == dict(choices, dry_run=True)
    expect(page.locator("#plansteps")).to_have_text(str(form_plan["steps"]))
    expect(page.locator("#planepochs")).to_have_text(str(form_plan["hyperparameters"]["n_epochs"]))
    api_plan = api(svc, "POST", JOBS, json=dict(choices, dry_run=True))
    cli_plan = json.loads(
        svc.cli("jobs", "create", "--dry-run", "--model", choices["model"],
                "--training-file", choices["training_file"]).stdout
    )  # fmt: skip
    assert without(form_plan, PER_PLAN) == without(api_plan, PER_PLAN) == without(cli_plan, PER_PLAN)

    # Submitted untouched, the form's job is the job of the same choices sent by the openai client
    # and the CLI: the same stored request, the same "auto" resolved, and a random seed for each.
    page.click("#submit")
    page.wait_for_url("**/jobs/ftjob-*")
    assert posts[-1] == choices
    form_id = page.url.rstrip("/").split("/")[-1]
    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.key)
    client_id = client.fine_tuning.jobs.create(**choices).id
    cli_out = svc.cli(
        "jobs", "create", "--model", choices["model"], "--training-file", choices["training_file"]
    )
    cli_id = json.loads(cli_out.stdout)["id"]
    jobs = [svc.wait_job(job_id, {"succeeded"}) for job_id in (form_id, client_id, cli_id)]
    jobs = [api(svc, "GET", f"{JOBS}/{j['id']}") for j in jobs]
    form_job, client_job, cli_job = jobs
    assert without(form_job, PER_JOB) == without(client_job, PER_JOB) == without(cli_job, PER_JOB)
    assert form_job["hyperparameters"]["n_epochs"] == form_plan["hyperparameters"]["n_epochs"]
    assert {j["progress"]["total_steps"] for j in jobs} == {form_plan["steps"]}
    seeds = [j["seed"] for j in jobs]
    assert len(set(seeds)) == 3 and 0 not in seeds, seeds  # drawn per job, not the form's 0
