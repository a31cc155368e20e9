"""The whole path, real processes: API (uvicorn) → Redis → Celery worker → tiny-llama training → DB
→ API, driven with httpx and the `loraq` CLI, on SQLite and on PostgreSQL."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.e2e.datasets import broken_lines, chat_lines
from tests.e2e.procs import Service, start_worker, stop_process

STEPS = 8  # 16 examples, batch 4, 2 epochs
RESULT_COLUMNS = ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]


def upload(svc: Service, data: bytes, name: str = "train.jsonl") -> str:
    with svc.client() as c:
        r = c.post("/files", data={"purpose": "fine-tune"}, files={"file": (name, data)})
        assert r.status_code == 200, r.text
        return str(r.json()["id"])


def create_job(svc: Service, body: dict[str, Any]) -> dict[str, Any]:
    with svc.client() as c:
        r = c.post("/fine_tuning/jobs", json=body)
        assert r.status_code == 200, r.text
        job: dict[str, Any] = r.json()
        return job


def all_events(svc: Service, job_id: str) -> list[dict[str, Any]]:
    with svc.client() as c:
        r = c.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 1000})
        assert r.status_code == 200, r.text
        events: list[dict[str, Any]] = r.json()["data"]
        return events


def tiny_job(file_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "training_file": file_id,
        "suffix": "e2e",
        "seed": 7,
        "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5.0},
        "lora": {"r": 4, "alpha": 8},
        "max_seq_len": 128,
        "packing": False,  # one example per row: the test counts steps
        **extra,
    }


def test_job_runs_end_to_end(e2e: Service, tmp_path: Path) -> None:
    svc = e2e
    file_id = upload(svc, chat_lines(16))
    job = create_job(svc, tiny_job(file_id))
    assert job["id"].startswith("ftjob-")
    assert job["status"] in {"validating_files", "queued"}
    # `loraq jobs watch` follows the job live, from queued to its end.
    watch = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "jobs", "watch", job["id"], "--interval", "0.2"],
        env=dict(svc.env, LORAQ_URL=svc.url, LORAQ_API_KEY=svc.key, COLUMNS="200"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    done = svc.wait_job(job["id"], {"succeeded"})
    assert "running" in done["_seen"], done["_seen"]
    watch_out, _ = watch.communicate(timeout=60)
    assert watch.returncode == 0, watch_out
    assert f"step {STEPS}/{STEPS}" in watch_out and "tok/s" in watch_out
    assert re.search(rf"succeeded in \S+( \S+)?: {re.escape(done['fine_tuned_model'])}", watch_out)
    assert done["fine_tuned_model"] == f"ft:tiny-llama:e2e:{job['id']}"
    assert done["trained_tokens"] > 0
    assert done["finished_at"] >= done["created_at"]
    assert done["error"] is None or not done["error"].get("code")

    # One metrics event per optimizer step, each with a finite loss.
    events = all_events(svc, job["id"])
    metrics = sorted((e["data"] for e in events if e["type"] == "metrics"), key=lambda d: d["step"])
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["train_loss"]) for m in metrics)
    messages = [e["message"] for e in events if e["type"] == "message"]
    assert sum("started" in m for m in messages) == 1

    # Checkpoints every 4 steps (LORAQ_CHECKPOINT_EVERY=4), listed newest first as OpenAI does.
    with svc.client() as c:
        ckpts = c.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
        assert sorted(ck["step_number"] for ck in ckpts) == [4, 8]
        assert all(ck["fine_tuning_job_id"] == job["id"] for ck in ckpts)

        # Metrics CSV as a result file, with OpenAI's columns and one row per step.
        (result_id,) = done["result_files"]
        content = c.get(f"/files/{result_id}/content")
        assert content.status_code == 200
        rows = list(csv.reader(io.StringIO(content.text)))
        assert rows[0] == RESULT_COLUMNS
        assert [int(r[0]) for r in rows[1:]] == list(range(1, STEPS + 1))

        models = [m["id"] for m in c.get("/models").json()["data"]]
        assert done["fine_tuned_model"] in models

    # The CLI: `jobs get`, `jobs download`.
    got = json.loads(svc.cli("jobs", "get", job["id"]).stdout)
    assert got["status"] == "succeeded"
    zip_path = tmp_path / "adapter.zip"
    svc.cli("jobs", "download", job["id"], "-o", str(zip_path))
    adapter_dir = tmp_path / "adapter"
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(adapter_dir)
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "tiny-llama"
    assert cfg["r"] == 4

    assert_peft_loads_and_changes_output(svc, adapter_dir)


def assert_peft_loads_and_changes_output(svc: Service, adapter_dir: Path) -> None:
    """The downloaded adapter loads with PEFT on tiny-llama and changes the model's logits."""
    import torch
    from peft import PeftModel

    from worker.engine.models import load_base_model

    loaded = load_base_model("tiny-llama", store=svc.data_dir / "models")
    base = loaded.model.eval()
    ids = loaded.tokenizer("ARRR! Answer number 3.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        before = base(input_ids=ids).logits.clone()
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b)  # trained away from zero init
    with torch.no_grad():
        after = peft_model(input_ids=ids).logits
    assert after.shape == before.shape
    assert not torch.allclose(after, before)


@pytest.mark.parametrize("e2e_db_url", ["sqlite"], indirect=True)
def test_cancel_mid_run_keeps_partial_metrics(e2e: Service) -> None:
    svc = e2e
    file_id = upload(svc, chat_lines(16))
    job = create_job(svc, tiny_job(file_id, hyperparameters={"n_epochs": 500, "batch_size": 4}))
    svc.wait_job(job["id"], {"running"})
    # Wait for a few steps' metrics to be in the database before cancelling.
    metric_events: list[dict[str, Any]] = []
    for _ in range(600):
        metric_events = [e for e in all_events(svc, job["id"]) if e["type"] == "metrics"]
        if len(metric_events) >= 3:
            break
        time.sleep(0.05)
    assert len(metric_events) >= 3

    out = svc.cli("jobs", "cancel", job["id"])
    assert job["id"] in out.stdout
    done = svc.wait_job(job["id"], {"cancelled"}, timeout=60)
    assert done["finished_at"] is not None
    assert done["fine_tuned_model"] is None

    steps = sorted(e["data"]["step"] for e in all_events(svc, job["id"]) if e["type"] == "metrics")
    assert len(steps) >= 3
    assert steps == list(range(1, len(steps) + 1))
    assert steps[-1] < 500 * 4  # stopped long before the end


@pytest.mark.parametrize("e2e_db_url", ["sqlite"], indirect=True)
def test_invalid_dataset_fails_quoting_line_numbers(e2e: Service) -> None:
    svc = e2e
    file_id = upload(svc, broken_lines(), name="broken.jsonl")
    with svc.client() as c:
        r = c.post("/fine_tuning/jobs", json=tiny_job(file_id))
    if r.status_code == 400:  # rejected while validating files, before queueing: also acceptable
        err = r.json()["error"]
    else:
        assert r.status_code == 200, r.text
        done = svc.wait_job(r.json()["id"], {"failed"})
        err = done["error"]
    assert err["param"] == "training_file"
    assert "line 2" in err["message"] and "line 4" in err["message"], err
    assert "line 1:" not in err["message"] and "line 3:" not in err["message"]


def test_duplicate_delivery_runs_the_job_once(e2e: Service, redis_url: str) -> None:
    """A second worker receives a duplicate of the job's message while the first one trains it."""
    svc = e2e
    second_log = svc.logs["worker"].with_name("worker2.log")
    svc.procs["worker2"] = start_worker(svc.env, second_log)
    try:
        run_with_duplicate(svc, redis_url, second_log)
    finally:
        stop_process(svc.procs.pop("worker2"))


def run_with_duplicate(svc: Service, redis_url: str, second_log: Path) -> None:
    log_start = len(svc.log_text("worker"))
    file_id = upload(svc, chat_lines(16))
    job = create_job(svc, tiny_job(file_id))
    svc.wait_job(job["id"], {"running"})
    sender = Celery(broker=redis_url)
    sender.send_task("loraq.run_job", args=[job["id"]], queue=svc.env["LORAQ_WORKER_QUEUE"])

    svc.wait_job(job["id"], {"succeeded"})
    events = all_events(svc, job["id"])
    starts = [e for e in events if e["type"] == "message" and "started" in e["message"]]
    assert len(starts) == 1
    steps = sorted(e["data"]["step"] for e in events if e["type"] == "metrics")
    assert steps == list(range(1, STEPS + 1))
    # The duplicate reached a worker and was skipped there (either worker may have got it).
    for _ in range(100):
        logs = svc.log_text("worker")[log_start:] + second_log.read_text(errors="replace")
        if f"job={job['id']} done: skipped" in logs:
            break
        time.sleep(0.1)
    assert f"job={job['id']} done: skipped" in logs


@pytest.mark.parametrize("e2e_db_url", ["postgresql"], indirect=True)
def test_worker_shutdown_requeues_job_and_next_worker_resumes_it(e2e: Service) -> None:
    svc = e2e
    file_id = upload(svc, chat_lines(16))
    hp = {"n_epochs": 6, "batch_size": 4, "learning_rate_multiplier": 5.0}  # 24 steps
    job = create_job(svc, tiny_job(file_id, hyperparameters=hp))
    svc.wait_job(job["id"], {"running"})
    for _ in range(600):
        if sum(e["type"] == "metrics" for e in all_events(svc, job["id"])) >= 2:
            break
        time.sleep(0.05)

    svc.stop_worker()  # SIGTERM: Celery's warm shutdown
    with svc.client() as c:
        back = c.get(f"/fine_tuning/jobs/{job['id']}").json()
        ckpts = c.get(f"/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"]
    assert back["status"] == "queued", back
    assert ckpts, "the stopped attempt left no checkpoint"
    assert any("re-queued" in e["message"] for e in all_events(svc, job["id"]))

    svc.start_worker()
    done = svc.wait_job(job["id"], {"succeeded"})
    events = all_events(svc, job["id"])
    steps = sorted(e["data"]["step"] for e in events if e["type"] == "metrics")
    assert steps == list(range(1, 25))  # resumed after the checkpoint; no step twice
    starts = [e["message"] for e in events if e["type"] == "message" and "started" in e["message"]]
    assert sorted(starts) == ["Fine-tuning job started (attempt 1)", "Fine-tuning job started (attempt 2)"]
    assert done["fine_tuned_model"] == f"ft:tiny-llama:e2e:{job['id']}"
