"""The same flow with the official `openai` package as the client, unmodified, against the real
processes (API, Redis, Celery worker), on SQLite and on PostgreSQL."""

from __future__ import annotations

import secrets
import time

import openai
import pytest

from service.job_status import TERMINAL
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service


def wait(
    client: openai.OpenAI, job_id: str, statuses: set[str], timeout: float = 240
) -> openai.types.fine_tuning.FineTuningJob:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if not seen or seen[-1] != job.status:
            seen.append(job.status)
        if job.status in statuses:
            return job
        assert job.status not in TERMINAL, f"job ended {job.status}: {job.error}"
        time.sleep(0.05)
    raise AssertionError(f"{job_id} stuck; seen {seen}")


def test_openai_package_drives_a_fine_tune(e2e: Service) -> None:
    # A tenant of its own: the job list below holds exactly this test's jobs.
    key = e2e.new_key(f"openai-{secrets.token_hex(4)}")
    client = openai.OpenAI(base_url=e2e.url + "/v1", api_key=key, max_retries=0)

    f = client.files.create(file=("train.jsonl", chat_lines(16)), purpose="fine-tune")
    assert f.id.startswith("file-") and f.purpose == "fine-tune" and f.bytes == len(chat_lines(16))
    assert client.files.retrieve(f.id).filename == "train.jsonl"

    job = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        suffix="oai",
        seed=3,
        hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5.0},
        # packing off: one example per row, so 16 examples / batch 4 x 2 epochs = 8 steps
        extra_body={"lora": {"r": 4, "alpha": 8}, "max_seq_len": 128, "packing": False},
    )
    assert job.status in {"validating_files", "queued"}
    assert job.model == "tiny-llama" and job.training_file == f.id

    done = wait(client, job.id, {"succeeded"})
    assert done.fine_tuned_model == f"ft:tiny-llama:oai:{job.id}"
    assert done.trained_tokens and done.trained_tokens > 0
    assert done.result_files and len(done.result_files) == 1
    csv_text = client.files.content(done.result_files[0]).text
    assert csv_text.splitlines()[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"

    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    metric_steps = sorted(e.data["step"] for e in events if e.type == "metrics" and e.data)  # type: ignore[index]
    assert metric_steps == list(range(1, 9))
    assert any(e.type == "message" for e in events)

    ckpts = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert sorted(c.step_number for c in ckpts) == [4, 8]
    assert all(c.fine_tuning_job_id == job.id for c in ckpts)

    model_ids = [m.id for m in client.models.list()]
    assert "tiny-llama" in model_ids and done.fine_tuned_model in model_ids

    # A second job, cancelled while queued or running, and pagination over both.
    other = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        hyperparameters={"n_epochs": 500},
        extra_body={"lora": {"r": 4}},
    )
    cancelled = client.fine_tuning.jobs.cancel(other.id)
    assert cancelled.status in {"cancelled", "running", "queued"}
    assert wait(client, other.id, {"cancelled"}, timeout=60).status == "cancelled"

    page = client.fine_tuning.jobs.list(limit=1)
    assert [j.id for j in page.data] == [other.id]  # newest first
    assert page.has_more
    page2 = client.fine_tuning.jobs.list(limit=1, after=other.id)
    assert [j.id for j in page2.data] == [job.id]
    assert not page2.has_more

    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-doesnotexist")
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as bad_model:
        client.fine_tuning.jobs.create(model="no-such-model", training_file=f.id)
    assert "no-such-model" in str(bad_model.value)
