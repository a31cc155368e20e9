"""A job that cannot run is refused at submit with 400 naming the field or the
line, instead of being accepted and failing (or waiting silently) later; Idempotency-Key reuse
with another body is a 409. Uploads are validated when they arrive (`status`, `status_details`)."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator

import pytest
import redis

from service import jobs, worker_registry
from service.db.session import session_scope
from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body
from tests.servers import shared_redis_url

BAD_FILE = DATASET + b"{not json\n" + b'{"messages": [{"role": "user", "content": "no answer"}]}\n'


def set_env(monkeypatch: pytest.MonkeyPatch, **values: str) -> None:
    for name, value in values.items():
        monkeypatch.setenv(f"LORAQ_{name.upper()}", value)
    get_settings.cache_clear()


def refused(r: object, param: str) -> dict[str, str]:
    assert r.status_code == 400, r.text  # type: ignore[attr-defined]
    err: dict[str, str] = r.json()["error"]  # type: ignore[attr-defined]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err


@pytest.fixture
def live_worker() -> Iterator[str]:
    """A worker registry entry (the format `worker.metrics` writes) for a one-GPU queue of its own,
    from a worker that can log jobs to MLflow but not to W&B."""
    queue = f"gpu-{secrets.token_hex(3)}"
    node = f"test-node-{secrets.token_hex(3)}"
    client = redis.Redis.from_url(shared_redis_url())
    entry = {
        "node": node, "queue": queue, "pid": 1, "gpus": [], "kernels": {}, "last_seen": time.time(),
        "integrations": ["mlflow"],
    }  # fmt: skip
    client.set(worker_registry.worker_key(node), json.dumps(entry), ex=60)
    worker_registry.forget_live_workers()  # forget the last read: the entry is new
    try:
        yield queue
    finally:
        client.delete(worker_registry.worker_key(node))
        worker_registry.forget_live_workers()


def test_upload_names_bad_lines_and_a_job_on_it_is_refused(api: ApiClient) -> None:
    file_id = api.upload(BAD_FILE)
    file = api.get(f"/v1/files/{file_id}").json()
    assert file["status"] == "error"
    assert file["status_details"].startswith("2 bad line(s): line 5: not valid JSON")
    assert "line 6: no assistant message" in file["status_details"]
    err = refused(api.post("/v1/fine_tuning/jobs", json=job_body(file_id)), "training_file")
    assert err["code"] == "invalid_file" and "line 5: not valid JSON" in err["message"]
    refused(
        api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(DATASET), validation_file=file_id)),
        "validation_file",
    )
    good = api.get(f"/v1/files/{api.upload(DATASET)}").json()
    assert good["status"] == "processed" and good["status_details"] is None
    assert api.get("/v1/fine_tuning/jobs").json()["data"] == []


def test_overlong_line_is_refused_without_reading_it(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    set_env(monkeypatch, max_line_bytes="2048")
    long_line = json.dumps({"text": "x" * 5000}).encode() + b"\n"
    file_id = api.upload(DATASET + long_line)
    details = api.get(f"/v1/files/{file_id}").json()["status_details"]
    assert f"line 5: line is {len(long_line)} bytes, over the limit of 2048 bytes per line" in details


def test_unknown_target_modules_list_the_models_layers(api: ApiClient) -> None:
    body = job_body(api.upload(DATASET), lora={"r": 4, "target_modules": ["q_proj", "attn.c_attn"]})
    err = refused(api.post("/v1/fine_tuning/jobs", json=body), "lora.target_modules")
    assert "'attn.c_attn' is not a linear layer of model 'tiny-llama'" in err["message"]
    assert "self_attn.q_proj" in err["message"] and "mlp.down_proj" in err["message"]
    ok = job_body(api.upload(DATASET), lora={"r": 4, "target_modules": ["self_attn.q_proj", "down_proj"]})
    assert api.post("/v1/fine_tuning/jobs", json=ok).status_code == 200


def test_unknown_model_is_refused_naming_the_known_ones(api: ApiClient) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(DATASET), model="gpt-9"))
    assert r.status_code == 404, r.text  # OpenAI's status for model_not_found
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert "known models: smollm2-135m-instruct" in err["message"]


def test_queue_and_n_gpus_no_worker_serves_are_refused(api: ApiClient, live_worker: str) -> None:
    file_id = api.upload(DATASET)
    err = refused(api.post("/v1/fine_tuning/jobs", json=job_body(file_id, queue="nobody-serves")), "queue")
    assert "queue 'nobody-serves': no registered worker serves it" in err["message"]
    assert live_worker in err["message"]  # the queues that are served
    err = refused(
        api.post("/v1/fine_tuning/jobs", json=job_body(file_id, queue=live_worker, n_gpus=4)), "n_gpus"
    )
    assert f"the workers of queue '{live_worker}' run jobs of at most 1 GPU(s)" in err["message"]
    ok = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, queue=live_worker))
    assert ok.status_code == 200 and ok.json()["waiting_for"] is None


def test_an_integration_no_worker_of_the_queue_can_log_is_refused(api: ApiClient, live_worker: str) -> None:
    file_id = api.upload(DATASET)
    wandb = {"type": "wandb", "wandb": {"project": "p"}}
    body = job_body(file_id, queue=live_worker, integrations=[{"type": "mlflow"}, wandb])
    err = refused(api.post("/v1/fine_tuning/jobs", json=body), "integrations[1].type")
    assert err["code"] == "integration_unavailable"
    assert f"no worker of queue '{live_worker}' can log to wandb" in err["message"]
    assert "WANDB_API_KEY" in err["message"] and "they can log to: mlflow" in err["message"]
    ok = api.post(
        "/v1/fine_tuning/jobs", json=job_body(file_id, queue=live_worker, integrations=[{"type": "mlflow"}])
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["integrations"] == [
        {"type": "mlflow", "wandb": None, "mlflow": {"experiment": "loraq", "run_name": None}}
    ]


def test_a_job_on_more_hosts_than_live_workers_or_with_integrations_is_refused(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch, live_worker: str
) -> None:
    file_id = api.upload(DATASET)
    # the hosts' rendezvous picks the one that reports only after the integrations' runs would open
    body = job_body(file_id, queue=live_worker, integrations=[{"type": "mlflow"}], n_nodes=2)
    err = refused(api.post("/v1/fine_tuning/jobs", json=body), "n_nodes")
    assert "a job on 2 hosts cannot log to integrations yet" in err["message"]
    # one live worker on the queue: a job that needs two at once would never start
    err = refused(
        api.post("/v1/fine_tuning/jobs", json=job_body(file_id, queue=live_worker, n_nodes=2)), "n_nodes"
    )
    assert err["code"] == "no_worker_for_job"
    assert f"needs 2 workers of queue '{live_worker}' at once, and 1 serve it now" in err["message"]
    one_host = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, queue=live_worker, n_nodes=1))
    assert one_host.status_code == 200, one_host.text
    set_env(monkeypatch, accept_unserved_jobs="1")  # workers that start on demand
    ok = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, queue=live_worker, n_nodes=2))
    assert ok.status_code == 200, ok.text
    assert ok.json()["n_nodes"] == 2


def test_operator_may_accept_unserved_queues(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch, live_worker: str
) -> None:
    set_env(monkeypatch, accept_unserved_jobs="1")
    r = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(DATASET), queue="autoscaled"))
    assert r.status_code == 200, r.text
    job = r.json()
    assert job["status"] == "queued"
    assert job["waiting_for"].startswith("a worker: queue 'autoscaled': no registered worker serves it")
    events = [e["message"] for e in api.get(f"/v1/fine_tuning/jobs/{job['id']}/events").json()["data"]]
    assert "Waiting for " + job["waiting_for"] in events


def test_idempotency_key_same_body_same_job_other_body_409(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    file_id = api.upload(DATASET)
    headers = {"Idempotency-Key": "key-17"}
    first = api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=headers)
    again = api.post("/v1/fine_tuning/jobs", json=job_body(file_id), headers=headers)
    assert first.status_code == again.status_code == 200 and again.json()["id"] == first.json()["id"]
    other = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, seed=2), headers=headers)
    assert other.status_code == 409, other.text
    err = other.json()["error"]
    assert err["code"] == "idempotency_key_reused" and err["param"] == "Idempotency-Key"
    assert first.json()["id"] in err["message"] and "different request body" in err["message"]
    # after the documented expiry the key is free again: a new job
    set_env(monkeypatch, idempotency_key_ttl_seconds="1")
    with session_scope() as s:
        from sqlalchemy import update

        from service.db.models import Job

        s.execute(update(Job).where(Job.id == first.json()["id"]).values(created_at=int(time.time()) - 10))
    reused = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, seed=2), headers=headers)
    assert reused.status_code == 200 and reused.json()["id"] != first.json()["id"]
    with session_scope() as s:
        assert jobs.get_job(s, tenant_id=api.tenant_id, job_id=first.json()["id"]).idempotency_key is None


def test_max_seq_len_shorter_than_examples_is_refused_with_counts(api: ApiClient) -> None:
    long_answer = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "tell"},
                {"role": "assistant", "content": "a long story " * 20},
            ]
        }
    )
    file_id = api.upload(DATASET + (long_answer + "\n").encode() * 2)
    err = refused(api.post("/v1/fine_tuning/jobs", json=job_body(file_id, max_seq_len=64)), "max_seq_len")
    assert err["code"] == "max_seq_len_too_short"
    assert "2 of the 6 examples in training_file are longer than max_seq_len 64 (line 5: " in err["message"]
    assert "and 4 would be left to train on" in err["message"]
    longest = int(err["message"].rsplit("at least ", 1)[1].split()[0])
    ok = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, max_seq_len=longest))
    assert ok.status_code == 200, ok.text
    # the validation file is checked too
    body = job_body(api.upload(DATASET), validation_file=file_id, max_seq_len=64)
    assert (
        "examples in validation_file"
        in refused(api.post("/v1/fine_tuning/jobs", json=body), "max_seq_len")["message"]
    )


def test_token_lengths_are_counted_once_per_file_and_tokenizer_and_stored_beside_it(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from collections import OrderedDict

    from service import files, token_lengths
    from service.storage import FileStore, default_store

    file_ids = [api.upload(DATASET), api.upload(DATASET + DATASET)]
    with session_scope() as s:
        rows = [files.get_file(s, tenant_id=api.tenant_id, file_id=f) for f in file_ids]
    counter = token_lengths.counter_for("tiny-llama")
    assert counter is not None and token_lengths.stored(rows[0], counter) is None
    assert token_lengths.count(rows[0], counter, seconds=0) is None  # no time: nothing counted
    assert token_lengths.stored(rows[0], counter) is None
    first = token_lengths.count(rows[0], counter)
    assert first is not None and len(first.tokens) == 4 and min(first.tokens) > 5
    assert list(first.lines) == [1, 2, 3, 4]
    assert token_lengths.stored(rows[0], counter) is first  # kept in memory: not read again
    # stored beside the file: another process (an empty cache here) reads them, counts nothing
    monkeypatch.setattr(token_lengths, "_cache", OrderedDict())
    monkeypatch.setattr(token_lengths, "_cached_bytes", 0)
    again = token_lengths.stored(rows[0], counter)
    assert again is not None and again is not first and again == first
    # a cache of 40 bytes holds one entry of 4 examples (32 bytes): the older one goes out
    monkeypatch.setattr(token_lengths, "CACHE_BYTES", 40)
    monkeypatch.setattr(token_lengths, "_cache", OrderedDict())
    monkeypatch.setattr(token_lengths, "_cached_bytes", 0)
    a = token_lengths.stored(rows[0], counter)
    assert a is not None and token_lengths.count(rows[1], counter) is not None  # 64 bytes: not kept
    key = (rows[0].storage_key, counter.fingerprint)
    assert list(token_lengths._cache) == [key] and token_lengths._cached_bytes == 32
    assert token_lengths.stored(rows[0], counter) is a
    # deleted with the file
    store = default_store()
    assert isinstance(store, FileStore)
    sidecar = store.path(token_lengths.lengths_key(rows[1], counter))
    assert sidecar.is_file()
    assert api.delete(f"/v1/files/{file_ids[1]}").status_code == 200
    assert not sidecar.exists() and not sidecar.parent.exists()


@pytest.mark.slow
def test_max_seq_len_is_checked_on_the_pulled_gguf_model(api: ApiClient) -> None:
    """smollm2-135m-instruct is a GGUF: counted with the tokenizer files its pull writes."""
    from tests.engine.conftest import TEST_MODEL_STORE, pull_test_model

    pull_test_model("smollm2-135m-instruct")  # cached across sessions; adds the tokenizer
    store = get_settings().model_store
    store.mkdir(parents=True, exist_ok=True)
    (store / "smollm2-135m-instruct").symlink_to(TEST_MODEL_STORE / "smollm2-135m-instruct")
    long_answer = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "tell"},
                {"role": "assistant", "content": "a long story " * 20},
            ]
        }
    )
    file_id = api.upload(DATASET + (long_answer + "\n").encode() * 2)
    body = job_body(file_id, model="smollm2-135m-instruct", max_seq_len=64)
    err = refused(api.post("/v1/fine_tuning/jobs", json=body), "max_seq_len")
    assert err["code"] == "max_seq_len_too_short"
    assert "2 of the 6 examples in training_file are longer than max_seq_len 64 (line 5: " in err["message"]
    longest = int(err["message"].rsplit("at least ", 1)[1].split()[0])
    ok = api.post("/v1/fine_tuning/jobs", json={**body, "max_seq_len": longest})
    assert ok.status_code == 200, ok.text
