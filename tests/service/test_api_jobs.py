"""/v1/fine_tuning/jobs and /v1/models through the real app on a real database, with the
worker's side driven through `service.jobs` (claim, metrics, checkpoints, finish)."""

from __future__ import annotations

import base64
import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import redis

from service import files, jobs, storage
from service.db.session import session_scope
from service.schemas import StoredCheckpointMetrics
from tests.conftest import DATASET, ApiClient, LoraqEnv, job_body
from tests.servers import shared_redis_url
from tests.service.test_api_files import assert_error
from tests.service.test_jobs_state import step
from worker.engine.catalog import TINY_LLAMA_SHAPE, random_weights_warning

OPENAI_JOB_FIELDS = {
    "id", "object", "created_at", "finished_at", "model", "fine_tuned_model", "organization_id", "status",
    "hyperparameters", "training_file", "validation_file", "result_files", "trained_tokens", "seed", "error",
    "estimated_finish", "integrations", "metadata", "method",
}  # fmt: skip


def queued_messages(env: LoraqEnv) -> list[dict[str, Any]]:
    r = redis.Redis.from_url(shared_redis_url())
    try:
        return [json.loads(m) for m in r.lrange(env.queue, 0, -1)]
    finally:
        r.close()


def test_create_job_returns_openai_object_and_enqueues_by_task_name(
    api: ApiClient, loraq_env: LoraqEnv
) -> None:
    file_id = api.upload(DATASET)
    job = api.create_job(file_id, metadata={"team": "pirates"})
    assert set(job) >= OPENAI_JOB_FIELDS
    assert job["id"].startswith("ftjob-") and job["object"] == "fine_tuning.job"
    assert job["status"] == "queued" and job["organization_id"] == api.tenant_id
    assert job["hyperparameters"] == {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 2.0}
    assert job["method"] == {"type": "supervised", "supervised": {"hyperparameters": job["hyperparameters"]}}
    assert job["metadata"] == {"team": "pirates"} and job["error"] is None and job["result_files"] == []
    assert job["lora"] == {
        "r": 4,
        "alpha": 8.0,
        "dropout": 0.0,
        "target_modules": "all-linear",
        "use_rslora": False,
    }
    assert job["packing"] is True  # padding-free packed rows unless the request opts out
    (msg,) = queued_messages(loraq_env)
    assert msg["headers"]["task"] == "loraq.run_job"
    assert json.loads(base64.b64decode(msg["body"]))[0] == [job["id"]]
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job


def test_packing_opt_out_is_stored_and_reaches_the_engine_config(api: ApiClient, tmp_path: Path) -> None:
    from service.settings import get_settings
    from worker.runner import build_train_config

    file_id = api.upload(DATASET)
    job = api.create_job(file_id, packing=False)
    assert job["packing"] is False and api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["packing"] is False
    with session_scope() as session:
        claim = jobs.claim(session, job_id=job["id"], worker_id="test-worker")
    assert claim is not None and claim.training.packing is False
    assert build_train_config(claim, get_settings(), tmp_path).pack is False


def test_method_hyperparameters_and_auto(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    body = job_body(
        file_id, method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}}
    )
    del body["hyperparameters"]
    job = api.post("/v1/fine_tuning/jobs", json=body).json()
    assert job["hyperparameters"] == {"n_epochs": 3, "batch_size": "auto", "learning_rate_multiplier": "auto"}
    both = job_body(
        file_id, method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 3}}}
    )
    assert_error(api.post("/v1/fine_tuning/jobs", json=both), 400, "hyperparameters")
    # a dpo job needs a preference file (tests/service/test_api_dpo.py)
    dpo = job_body(file_id, method={"type": "dpo"})
    del dpo["hyperparameters"]
    assert_error(api.post("/v1/fine_tuning/jobs", json=dpo), 400, "training_file")


@pytest.mark.parametrize(
    ("override", "param"),
    [
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"n_epochs": 2.5}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"n_epochs": "many"}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"batch_size": -1}}, "hyperparameters.batch_size"),
        ({"hyperparameters": {"learning_rate_multiplier": 0}}, "hyperparameters.learning_rate_multiplier"),
        ({"hyperparameters": {"learning_rate_multiplier": True}}, "hyperparameters.learning_rate_multiplier"),
        ({"hyperparameters": {"warmup": 3}}, "hyperparameters.warmup"),
        ({"lora": {"r": 0}}, "lora.r"),
        ({"lora": {"dropout": 1.0}}, "lora.dropout"),
        ({"lora": {"target_modules": "everything"}}, "lora.target_modules"),
        ({"max_seq_len": 4}, "max_seq_len"),
        ({"packing": "sometimes"}, "packing"),
        ({"seed": -1}, "seed"),
        ({"suffix": "bad suffix!"}, "suffix"),
        ({"status": "succeeded"}, "status"),
        ({"id": "ftjob-mine"}, "id"),
        ({"organization_id": "org-x"}, "organization_id"),
        ({"integrations": [{"type": "wandb"}]}, "integrations[0]"),
        ({"integrations": [{"type": "comet", "comet": {}}]}, "integrations[0].type"),
        (
            {"integrations": [{"type": "wandb", "wandb": {"project": "p", "api_key": "k"}}]},
            "integrations[0].wandb.api_key",
        ),
        (
            {"integrations": [{"type": "mlflow", "mlflow": {"tracking_uri": "http://x"}}]},
            "integrations[0].mlflow.tracking_uri",
        ),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),  # the key, over 64 characters
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"model": "gpt-9"}, "model"),
        ({"training_file": "file-nope"}, "training_file"),
        ({"validation_file": "file-nope"}, "validation_file"),
    ],
)
def test_bad_job_requests_are_400_naming_the_param(
    api: ApiClient, override: dict[str, Any], param: str
) -> None:
    """Malformed values: 400; well-formed names of things that do not exist (model, files): 404."""
    file_id = api.upload(DATASET)
    body = job_body(file_id)
    body.update(override)
    status = 404 if param in ("model", "training_file", "validation_file") else 400
    assert_error(api.post("/v1/fine_tuning/jobs", json=body), status, param)
    assert api.get("/v1/fine_tuning/jobs").json()["data"] == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{nope", "Expecting property name enclosed in double quotes at byte 1"),
        (b"\xff\xfe", "Expecting value at byte 0"),
        (b"[" * 100_000, "nested too deeply"),  # json.loads raises RecursionError
        (b'{"seed": 1' + b"0" * 5000 + b"}", "Exceeds the limit (4300 digits)"),  # ValueError
    ],
)
@pytest.mark.parametrize("path", ["/v1/fine_tuning/jobs", "/v1/chat/completions"])
def test_a_body_that_is_not_json_is_400_invalid_json(
    api: ApiClient, path: str, body: bytes, reason: str
) -> None:
    r = api.post(path, content=body, headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, "body")
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert str(err["message"]).startswith(f"the request body is not valid JSON: {reason}"), err


def test_missing_body_and_bad_fields(api: ApiClient) -> None:
    assert_error(api.post("/v1/fine_tuning/jobs"), 400)
    assert_error(api.post("/v1/fine_tuning/jobs", json={"training_file": "f"}), 400, "model")


def test_idempotency_key_returns_the_same_job(api: ApiClient, loraq_env: LoraqEnv) -> None:
    file_id = api.upload(DATASET)
    h = {"Idempotency-Key": "retry-123"}
    first = api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=h).json()
    second = api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=h).json()
    assert first["id"] == second["id"]
    assert len(api.get("/v1/fine_tuning/jobs").json()["data"]) == 1
    assert len(queued_messages(loraq_env)) == 1  # the replay is not enqueued again
    # The same key from another tenant is another tenant's key.
    other_file = api.other.upload(DATASET)  # type: ignore[union-attr]
    theirs = api.other.post("/v1/fine_tuning/jobs", json=job_body(other_file), headers=h).json()  # type: ignore[union-attr]
    assert theirs["id"] != first["id"]


def test_list_jobs_cursor_pagination(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    ids = [api.create_job(file_id)["id"] for _ in range(5)]
    page = api.get("/v1/fine_tuning/jobs", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    seen = [j["id"] for j in page["data"]]
    while page["has_more"]:
        page = api.get("/v1/fine_tuning/jobs", params={"limit": 2, "after": seen[-1]}).json()
        seen += [j["id"] for j in page["data"]]
    assert seen == ids[::-1]  # newest first, every job exactly once
    last = api.get("/v1/fine_tuning/jobs", params={"limit": 5}).json()
    assert last["has_more"] is False and len(last["data"]) == 5
    assert_error(api.get("/v1/fine_tuning/jobs", params={"limit": 101}), 400, "limit")
    assert_error(api.get("/v1/fine_tuning/jobs", params={"after": "ftjob-unknown"}), 404, "after")


def run_job_to_success(api: ApiClient, job_id: str, steps: int = 3) -> None:
    """What a worker does, through the state machine: claim, metrics, checkpoint, artifacts, finish."""
    with session_scope() as s:
        c = jobs.claim(s, job_id=job_id, worker_id="test-worker")
    assert c is not None
    with session_scope() as s:
        jobs.add_event(s, job_id=job_id, level="info", message="Fine-tuning job started")
        jobs.record_metrics(
            s, claim=c, rows=[step(i, total=steps, loss=3.0 - i / 10) for i in range(1, steps + 1)]
        )
    ckpt = storage.put_bytes(f"jobs/{job_id}/checkpoints/step-2.zip", b"checkpoint-zip")
    with session_scope() as s:
        jobs.register_checkpoint(
            s,
            claim=c,
            step=2,
            storage_key=ckpt.key,
            sha256=ckpt.sha256,
            metrics=StoredCheckpointMetrics(step=2, train_loss=2.8),
        )
    adapter = storage.put_bytes(f"jobs/{job_id}/adapter.zip", b"adapter-zip")
    with session_scope() as s:
        rows = jobs.metric_rows(s, job_id=job_id)
        text = "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy\n" + "".join(
            f"{r.step},{r.train_loss},,,\n" for r in rows
        )
        results = files.create_file_from_bytes(
            s,
            tenant_id=c.tenant_id,
            filename="results.csv",
            purpose="fine-tune-results",
            content=text.encode(),
        )
        assert jobs.finish(
            s,
            claim=c,
            status="succeeded",
            trained_tokens=300,
            adapter_key=adapter.key,
            adapter_sha256=adapter.sha256,
            result_file_id=results.id,
            fine_tuned_model=f"ft:tiny-llama:t:{job_id}",
        )


def test_finished_job_events_checkpoints_results_adapter_and_models(api: ApiClient) -> None:
    job = api.create_job(api.upload(DATASET))
    jid = job["id"]
    assert_error(api.get(f"/v1/fine_tuning/jobs/{jid}/adapter"), 404)
    run_job_to_success(api, jid)

    done = api.get(f"/v1/fine_tuning/jobs/{jid}").json()
    assert done["status"] == "succeeded" and done["trained_tokens"] == 300
    assert done["fine_tuned_model"] == f"ft:tiny-llama:t:{jid}"
    assert done["finished_at"] >= done["created_at"]
    assert done["progress"]["step"] == 3 and done["progress"]["total_steps"] == 3

    events = api.get(f"/v1/fine_tuning/jobs/{jid}/events", params={"limit": 100}).json()
    assert events["object"] == "list" and events["has_more"] is False
    assert all(e["object"] == "fine_tuning.job.event" for e in events["data"])
    metrics = [e["data"] for e in events["data"] if e["type"] == "metrics"]
    assert sorted(m["step"] for m in metrics) == [1, 2, 3]
    assert {"step", "train_loss", "valid_loss", "lr", "grad_norm", "tokens_per_s", "eta_seconds"} <= set(
        metrics[0]
    )
    # events page by page, newest first, without gaps
    page = api.get(f"/v1/fine_tuning/jobs/{jid}/events", params={"limit": 2}).json()
    seen = [e["id"] for e in page["data"]]
    while page["has_more"]:
        page = api.get(f"/v1/fine_tuning/jobs/{jid}/events", params={"limit": 2, "after": seen[-1]}).json()
        seen += [e["id"] for e in page["data"]]
    assert seen == [e["id"] for e in events["data"]]

    ckpts = api.get(f"/v1/fine_tuning/jobs/{jid}/checkpoints").json()
    (ck,) = ckpts["data"]
    assert ck["object"] == "fine_tuning.job.checkpoint" and ck["id"].startswith("ftckpt-")
    assert (ck["step_number"], ck["fine_tuning_job_id"]) == (2, jid)
    assert ck["metrics"] == {"step": 2, "train_loss": 2.8, "valid_loss": None, "full_valid_loss": None}
    assert ck["fine_tuned_model_checkpoint"] == f"ft:tiny-llama:t:{jid}:ckpt-step-2"
    assert api.get(f"/v1/fine_tuning/jobs/{jid}/checkpoints/{ck['id']}/adapter").content == b"checkpoint-zip"

    (result_id,) = done["result_files"]
    rows = list(csv.reader(io.StringIO(api.get(f"/v1/files/{result_id}/content").text)))
    assert rows[0] == ["step", "train_loss", "train_accuracy", "valid_loss", "valid_mean_token_accuracy"]
    assert [r[0] for r in rows[1:]] == ["1", "2", "3"]
    assert api.get(f"/v1/files/{result_id}").json()["purpose"] == "fine-tune-results"

    adapter = api.get(f"/v1/fine_tuning/jobs/{jid}/adapter")
    assert adapter.status_code == 200 and adapter.content == b"adapter-zip"
    assert adapter.headers["content-type"] == "application/zip"

    models = api.get("/v1/models").json()
    ids = [m["id"] for m in models["data"]]
    assert "tiny-llama" in ids and done["fine_tuned_model"] in ids
    by_id = {m["id"]: m for m in models["data"]}
    # random-init bases (and adapters trained on them) are labelled random; pretrained ones are not
    assert by_id["tiny-llama"]["random"] is True and "random-init" in by_id["tiny-llama"]["description"]
    assert by_id["smollm2-135m-instruct"]["random"] is False
    got = api.get(f"/v1/models/{done['fine_tuned_model']}").json()
    assert got == {
        "id": done["fine_tuned_model"],
        "object": "model",
        "created": done["finished_at"],
        "owned_by": api.tenant_id,
        "random": True,
        "description": None,
        "local": True,
        "auto_pull": None,  # a fine-tuned model is never pulled
        "use": "tests",  # a fine-tune of the test-only base is test-only too
        "upstream": None,
        "warning": random_weights_warning("tiny-llama"),  # and says its base is random
        # what a user picks a base by, the fine-tune carrying its base's (kind: bases only)
        "kind": None,
        "family": "Llama",
        "parameters": TINY_LLAMA_SHAPE.parameter_count(),
        "context_length": TINY_LLAMA_SHAPE.max_position_embeddings,
        # the smallest GPU is said of bases (their default job); a fine-tune says none
        "min_gpu_memory_gb": None,
        "min_gpu": None,
    }
    assert_error(api.get("/v1/models/ft:nope"), 404, "model")
    # another tenant sees only base models
    theirs = [m["id"] for m in api.other.get("/v1/models").json()["data"]]  # type: ignore[union-attr]
    assert done["fine_tuned_model"] not in theirs and "tiny-llama" in theirs
    # the file a finished job used can be deleted now; a finished job cannot be cancelled
    assert_error(api.post(f"/v1/fine_tuning/jobs/{jid}/cancel"), 400, "fine_tuning_job_id")


def test_adapter_download_rechecks_sha256(api: ApiClient, loraq_env: LoraqEnv) -> None:
    jid = api.create_job(api.upload(DATASET))["id"]
    run_job_to_success(api, jid)
    (loraq_env.store_root / "jobs" / jid / "adapter.zip").write_bytes(b"adapter-zap")
    assert assert_error(api.get(f"/v1/fine_tuning/jobs/{jid}/adapter"), 500)["code"] == "storage_error"


def test_cancel_queued_and_running(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    queued = api.create_job(file_id)
    r = api.post(f"/v1/fine_tuning/jobs/{queued['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "cancelled" and r.json()["finished_at"]
    running = api.create_job(file_id)
    with session_scope() as s:
        assert jobs.claim(s, job_id=running["id"], worker_id="w") is not None
    r = api.post(f"/v1/fine_tuning/jobs/{running['id']}/cancel")
    assert r.status_code == 200 and r.json()["status"] == "running"  # the worker ends it within a step
    with session_scope() as s:
        assert jobs.is_cancel_requested(s, job_id=running["id"])
    messages = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{running['id']}/events").json()["data"]]
    assert "Cancellation requested" in messages


def test_file_in_use_by_an_unfinished_job_cannot_be_deleted(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    job = api.create_job(file_id)
    assert_error(api.delete(f"/v1/files/{file_id}"), 409, "file_id")
    api.post(f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    assert api.delete(f"/v1/files/{file_id}").status_code == 200


def test_unknown_ids_are_404(api: ApiClient) -> None:
    for path in (
        "/v1/fine_tuning/jobs/ftjob-nope",
        "/v1/fine_tuning/jobs/ftjob-nope/events",
        "/v1/fine_tuning/jobs/ftjob-nope/checkpoints",
        "/v1/fine_tuning/jobs/ftjob-nope/adapter",
        "/v1/files/file-nope",
        "/v1/files/file-nope/content",
        "/v1/no/such/route",
    ):
        assert_error(api.get(path), 404)
    assert_error(api.post("/v1/fine_tuning/jobs/ftjob-nope/cancel"), 404)


def test_ids_with_nul_bytes_are_404_not_500(api: ApiClient) -> None:
    """PostgreSQL refuses NUL in text; ids that cannot exist never reach the database. A NUL in
    the query string is refused before any route runs: 400 naming the parameter."""
    for path in (
        "/v1/files/file-%00x",
        "/v1/files/file-%00x/content",
        "/v1/fine_tuning/jobs/ftjob-%00",
        "/v1/fine_tuning/jobs/ftjob-%00/events",
        "/v1/fine_tuning/jobs/ftjob-%00/checkpoints",
        "/v1/models/a%00b",
    ):
        assert_error(api.get(path), 404)
    for path in ("/v1/files?after=%00", "/v1/fine_tuning/jobs?after=%00"):
        assert_error(api.get(path), 400, "after")
    file_id = api.upload(DATASET)
    job_id = api.create_job(file_id)["id"]
    for path in (
        f"/v1/fine_tuning/jobs/{job_id}/events?after=%00",
        f"/v1/fine_tuning/jobs/{job_id}/checkpoints?after=x%00",
    ):
        assert_error(api.get(path), 400, "after")
    assert_error(api.post("/v1/fine_tuning/jobs", json=job_body("file-\u0000")), 404, "training_file")
    assert_error(
        api.post("/v1/fine_tuning/jobs", json=job_body(file_id, validation_file="\u0000")),
        404,
        "validation_file",
    )


def test_broker_down_job_is_still_created_and_queued(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The database is the source of truth: with Redis unreachable the job is created `queued`
    (for the reconciler to re-send) and the request neither fails nor hangs."""
    import time

    from service import queue
    from service.settings import get_settings
    from service.up import free_port

    file_id = api.upload(DATASET)
    # The failed publish pauses publishing for a few seconds; restored to "not paused" at teardown,
    # so the next test's jobs are published at once.
    monkeypatch.setattr(queue._publisher, "_paused_until", 0.0)
    monkeypatch.setenv("LORAQ_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    get_settings.cache_clear()
    t0 = time.monotonic()
    job = api.create_job(file_id)
    assert time.monotonic() - t0 < 10
    assert job["status"] == "queued"
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json()["status"] == "queued"


def test_metadata_with_lone_surrogates_is_400(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    raw = json.dumps(job_body(file_id)).replace(
        '"suffix": "t"', '"suffix": "t", "metadata": {"k": "\\ud800"}'
    )
    r = api.post("/v1/fine_tuning/jobs", content=raw.encode(), headers={"Content-Type": "application/json"})
    assert_error(r, 400, "metadata.k")
    ok = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, metadata={"k\u00e9": "v\U0001f600\u0000"}))
    assert ok.status_code == 200 and ok.json()["metadata"] == {"k\u00e9": "v\U0001f600\u0000"}


def test_lora_null_means_the_default_adapter_shape(api: ApiClient) -> None:
    file_id = api.upload(DATASET)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, lora=None))
    assert r.status_code == 200, r.text
    assert r.json()["lora"]["r"] == 16 and r.json()["lora"]["target_modules"] == "all-linear"
