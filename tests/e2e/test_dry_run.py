"""`"dry_run": true` on POST /v1/fine_tuning/jobs (and `loraq jobs create --dry-run`) against the
real processes: the plan's steps and tokens equal what a real tiny-llama run of the same request
then does, nothing is queued, and a broken file comes back as per-line errors."""

from __future__ import annotations

import json
import secrets
from typing import Any

from tests.e2e.datasets import broken_lines, chat_lines
from tests.e2e.procs import Service


def upload(c: Any, content: bytes) -> str:
    r = c.post("/files", data={"purpose": "fine-tune"}, files={"file": ("d.jsonl", content)})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_dry_run_plan_equals_the_real_run(e2e: Service) -> None:
    e2e.start_inference()
    key = e2e.new_key(f"dry-{secrets.token_hex(4)}")
    with e2e.client(key) as c:
        train, valid = upload(c, chat_lines(10)), upload(c, chat_lines(3))
        body = {
            "model": "tiny-llama",
            "training_file": train,
            "validation_file": valid,
            "hyperparameters": {"n_epochs": 3},  # batch_size "auto"
            "lora": {"r": 4},
            "max_seq_len": 128,
        }
        plan = c.post("/fine_tuning/jobs", json={**body, "dry_run": True}).json()
        assert plan["object"] == "fine_tuning.job.dry_run" and plan["valid"] and plan["errors"] == []
        assert c.get("/fine_tuning/jobs").json()["data"] == []  # nothing was created
        examples = plan["training_file"]["examples"]
        assert examples == 10 and plan["validation_file"]["examples"] == 3
        assert 0 < plan["training_file"]["trainable_tokens"] < plan["training_file"]["tokens"]
        batch = plan["hyperparameters"]["batch_size"]
        assert plan["hyperparameters"]["n_epochs"] == 3 and isinstance(batch, int)
        rows = plan["training_file"]["rows"]  # packed (the default): several examples a row
        assert plan["packing"] and 0 < rows < examples
        assert plan["steps"] == 3 * plan["steps_per_epoch"] == 3 * -(-rows // batch)
        assert plan["estimates"] == []  # no benchmark row for tiny-llama

        job = c.post("/fine_tuning/jobs", json=body).json()
        done = e2e.wait_job(job["id"], {"succeeded"}, key=key)
        events = c.get(f"/fine_tuning/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    assert done["progress"]["total_steps"] == plan["steps"]
    assert sum(e["type"] == "metrics" for e in events) == plan["steps"]
    assert done["trained_tokens"] == plan["trained_tokens"]  # exact: every epoch sees every token
    assert done["hyperparameters"]["batch_size"] == batch

    # Without packing: one example a row, so more steps, the same tokens.
    with e2e.client(key) as c:
        unpacked = c.post("/fine_tuning/jobs", json={**body, "packing": False, "dry_run": True}).json()
    assert unpacked["training_file"]["rows"] == examples
    assert (
        unpacked["steps"] == 3 * -(-examples // batch)
        and unpacked["trained_tokens"] == plan["trained_tokens"]
    )


def test_dry_run_lists_invalid_lines_and_estimates_gpu_classes(e2e: Service) -> None:
    e2e.start_inference()
    with e2e.client() as c:
        bad = upload(c, broken_lines())
        plan = c.post(
            "/fine_tuning/jobs", json={"model": "tiny-llama", "training_file": bad, "dry_run": True}
        ).json()
        assert plan["valid"] is False
        assert [(e["param"], e["line"]) for e in plan["errors"]] == [
            ("training_file", 2),
            ("training_file", 4),
        ]
        assert plan["training_file"]["examples"] == 2

        good = upload(c, chat_lines(8))
        big = {
            "model": "llama-1b",
            "training_file": good,
            "dry_run": True,
            "hyperparameters": {"batch_size": 2},
        }
        plan = c.post("/fine_tuning/jobs", json=big).json()
        (h100,) = plan["estimates"]
        assert h100["worker_class"] == "h100" and h100["source"].startswith("bench/results/train-h100-")
        assert h100["wall_seconds"] == round(plan["trained_tokens"] / 81930, 1)
        assert 2.0 < h100["peak_gpu_memory_gib"] < 12.4  # weights (~2.3 GiB bf16) + a short step

        missing = c.post("/fine_tuning/jobs", json={**big, "training_file": "file-nope"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "training_file"

    out = e2e.cli("jobs", "create", "--model", "tiny-llama", "--training-file", good, "--n-epochs", "2",
                  "--dry-run")  # fmt: skip
    cli_plan = json.loads(out.stdout)
    assert (
        cli_plan["object"] == "fine_tuning.job.dry_run"
        and cli_plan["steps"] == 2 * cli_plan["steps_per_epoch"]
    )
