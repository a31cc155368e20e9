"""`"dry_run": true` on POST /v1/fine_tuning/jobs (and `loraq jobs create --dry-run`) against the
real processes: the plan's steps and tokens equal what a real tiny-llama run of the same request
then does (with a validation file, with the default validation holdout, with grad_accum > 1,
packed and not), nothing is queued, a broken file comes back as per-line errors, and every
worker class says its estimate (peak memory: the memory plan's) or why there is none."""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import pytest

from service.estimates import TABLES
from service.gpu_fit import H100
from tests.e2e.datasets import broken_lines, chat_lines, varied_chat_lines
from tests.e2e.procs import Service
from worker.engine.catalog import PRESET_SHAPES
from worker.engine.memory_plan import MemoryPlan, ModelDims, plan_memory


def h100_plan(preset: str, *, rows: int, seq: int) -> MemoryPlan:
    """The engine's memory plan of a job left to the LoRA defaults (r 16, every linear layer) on
    an 80 GB H100, as the worker would make it on the captured step (no offload)."""
    return plan_memory(
        ModelDims.from_config(PRESET_SHAPES[preset].config_kwargs()),
        rank=16,
        targets="all-linear",
        rows=rows,
        seq=seq,
        gpu_bytes=H100.memory_bytes,
        allow_offload=False,
    )


def upload(c: Any, content: bytes) -> str:
    r = c.post("/files", data={"purpose": "fine-tune"}, files={"file": ("d.jsonl", content)})
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


# (training examples, validation examples or None, request fields). Without a validation file and
# from 100 examples on, the job holds out the server's default 5% (worker/engine/holdout.py); the
# 120-example cases train on 114 and validate on 6, the 64-example one holds nothing out.
CASES: dict[str, tuple[int, int | None, dict[str, Any]]] = {
    "validation file, packed": (10, 3, {"hyperparameters": {"n_epochs": 3}}),  # batch_size "auto"
    "holdout, grad_accum 3, packed": (120, None, {"hyperparameters": {"n_epochs": 2}, "grad_accum": 3}),
    "holdout, grad_accum 2, unpacked": (
        120,
        None,
        {"hyperparameters": {"n_epochs": 1, "batch_size": 8}, "grad_accum": 2, "packing": False},
    ),
    "too few for a holdout, packed": (64, None, {"hyperparameters": {"n_epochs": 1}}),
}


def _event(events: list[dict[str, Any]], prefix: str) -> str:
    (message,) = [e["message"] for e in events if e["message"].startswith(prefix)]
    return str(message)


@pytest.mark.parametrize("case", list(CASES))
def test_dry_run_plan_equals_the_real_run(e2e: Service, case: str) -> None:
    n_train, n_valid, fields = CASES[case]
    e2e.start_inference()
    key = e2e.new_key(f"dry-{secrets.token_hex(4)}")
    with e2e.client(key) as c:
        body: dict[str, Any] = {
            "model": "tiny-llama",
            "training_file": upload(c, varied_chat_lines(n_train)),
            "lora": {"r": 4},
            "max_seq_len": 128,
            **fields,
        }
        if n_valid is not None:
            body["validation_file"] = upload(c, chat_lines(n_valid))
        plan = c.post("/fine_tuning/jobs", json={**body, "dry_run": True}).json()
        assert plan["object"] == "fine_tuning.job.dry_run" and plan["valid"] and plan["errors"] == []
        assert c.get("/fine_tuning/jobs").json()["data"] == []  # nothing was created
        trained = plan["training"]
        held_out = 0 if n_valid is not None or n_train < 100 else 6  # round(0.05 · 120)
        assert plan["validation_split"] == (0.0 if n_valid is not None else 0.05)
        assert plan["training_file"]["examples"] == n_train and trained["held_out_examples"] == held_out
        assert trained["examples"] == n_train - held_out
        assert 0 < trained["trainable_tokens"] < trained["tokens"] <= plan["training_file"]["tokens"]
        if body.get("packing", True):  # examples share rows of up to row_tokens (auto may shorten them)
            assert 0 < trained["rows"] <= trained["examples"] and plan["row_tokens"] <= body["max_seq_len"]
        else:
            assert trained["rows"] == trained["examples"]
        assert plan["grad_accum"] == body.get("grad_accum", 1)

        # The plan's seed (drawn for this request) makes the job hold out the same examples.
        job = c.post("/fine_tuning/jobs", json={**body, "seed": plan["seed"]}).json()
        done = e2e.wait_job(job["id"], {"succeeded"}, key=key)
        events = c.get(f"/fine_tuning/jobs/{job['id']}/events", params={"limit": 1000}).json()["data"]
    assert done["hyperparameters"] == plan["hyperparameters"]
    assert "Plan: " + plan["plan"] in [
        e["message"] for e in events
    ]  # the engine planned the same, word for word
    assert done["progress"]["total_steps"] == plan["steps"]
    assert sum(e["type"] == "metrics" for e in events) == plan["steps"]
    assert done["trained_tokens"] == plan["trained_tokens"]  # exact: every epoch sees every token
    # the engine's own account of its data (worker/engine/recipe.py), token for token
    assert _event(events, "Training data:") == (
        f"Training data: {trained['examples']} examples, {trained['tokens']:,} tokens "
        f"({trained['trainable_tokens']:,} trainable) in {trained['rows']} rows; {plan['steps']} steps"
    )
    if held_out:
        assert _event(events, "Validation:").startswith(f"Validation: {held_out} examples held out")
    if n_valid is None:  # the plan and the job's page say what the engine's event says, word for word
        assert plan["validation"] in [e["message"] for e in events]
        assert plan["validation"].startswith("Validation: 6 " if held_out else "No validation holdout: 64 ")
        auth = {"Authorization": f"Bearer {key}"}
        page = httpx.get(f"{e2e.url}/dashboard/api/jobs/{job['id']}/progress", headers=auth).json()
        assert page["validation"] == plan["validation"]
    else:
        assert plan["validation"] == f"Validation on the validation file {body['validation_file']}; " + (
            "nothing held out of the training file"
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
        by_class = {e["worker_class"]: e for e in plan["estimates"]}
        queue = e2e.env["LORAQ_WORKER_QUEUE"]  # the job's own class: never benchmarked
        assert sorted(by_class) == sorted(["h100", queue])
        h100, own = by_class["h100"], by_class[queue]
        row = TABLES["h100"]["llama-1b"]  # the benchmark row the service's table holds
        assert h100["source"] == f"bench/results/{row.source}"
        assert h100["wall_seconds"] == round(plan["trained_tokens"] / row.tokens_per_s, 1)
        # the peak is the memory plan's for this job's step (2 rows of row_tokens) on an 80 GB H100
        expected = h100_plan("llama-1b", rows=2, seq=plan["row_tokens"])
        assert h100["peak_gpu_memory_gib"] == round(expected.peak_bytes / 2**30, 2)
        assert h100["memory_plan"]["activation_checkpointing"] == expected.choice.checkpointing
        assert h100["memory_plan"]["micro_batch_rows"] == expected.choice.micro_rows
        assert h100["unavailable"] is None
        assert own["wall_seconds"] is None and own["peak_gpu_memory_gib"] is None  # its GPU is not known
        assert "no training benchmark for worker class" in own["unavailable"]

        tiny = c.post("/fine_tuning/jobs", json={**big, "model": "tiny-llama"}).json()
        h100 = next(e for e in tiny["estimates"] if e["worker_class"] == "h100")
        # no benchmark row: no wall time, but the plan needs only the model's shape
        assert h100["wall_seconds"] is None and "no training benchmark of tiny-llama" in h100["unavailable"]
        expected = h100_plan("tiny-llama", rows=2, seq=tiny["row_tokens"])
        assert h100["peak_gpu_memory_gib"] == round(expected.peak_bytes / 2**30, 2)

        # batch_scaling per_gpu on 2 GPUs: 2 rows on each GPU (the memory plan's), a global batch
        # of 4, half the steps of one GPU's 2-row batch, the rate x sqrt(2), and the plan says why
        one_row = {**big, "model": "tiny-llama", "packing": False}  # 8 examples, 8 rows
        alone = c.post("/fine_tuning/jobs", json=one_row).json()
        weak = c.post("/fine_tuning/jobs", json={**one_row, "n_gpus": 2, "batch_scaling": "per_gpu"}).json()
        assert (alone["global_batch_size"], weak["global_batch_size"]) == (2, 4)
        assert weak["batch_scaling"] == "per_gpu" and weak["hyperparameters"] == alone["hyperparameters"]
        assert 2 * weak["steps"] == alone["steps"] > 0
        assert weak["learning_rate"] == pytest.approx(2**0.5 * alone["learning_rate"])
        assert "2 row(s) per GPU x 2 GPUs = 4 row(s)" in weak["plan"] and "square-root rule" in weak["plan"]
        h100 = next(e for e in weak["estimates"] if e["worker_class"] == "h100")
        expected = h100_plan("tiny-llama", rows=2, seq=weak["row_tokens"])
        assert h100["peak_gpu_memory_gib"] == round(expected.peak_bytes / 2**30, 2)

        missing = c.post("/fine_tuning/jobs", json={**big, "training_file": "file-nope"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "training_file"

    out = e2e.cli("jobs", "create", "--model", "tiny-llama", "--training-file", good, "--n-epochs", "2",
                  "--dry-run")  # fmt: skip
    cli_plan = json.loads(out.stdout)
    assert (
        cli_plan["object"] == "fine_tuning.job.dry_run"
        and cli_plan["steps"] == 2 * cli_plan["micro_batches_per_epoch"]
    )
