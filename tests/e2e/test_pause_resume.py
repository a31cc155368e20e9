"""Pause and resume with the official `openai` package, unmodified, against the real processes
(API, Redis, a Celery worker training tiny-llama), on SQLite and on PostgreSQL: the paused job's
worker takes another job meanwhile, and the resumed job finishes every step once from the
checkpoint of the step it paused at. Integrations this worker cannot log are refused at submit."""

from __future__ import annotations

import secrets
import time
from typing import Any

import openai
import pytest

from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service
from tests.e2e.test_openai_client import wait

TRAINING: dict[str, Any] = {"lora": {"r": 4, "alpha": 8}, "max_seq_len": 128, "packing": False}


def progress(job: openai.types.fine_tuning.FineTuningJob) -> dict[str, Any]:
    extra: dict[str, Any] = job.model_extra or {}
    return dict(extra["progress"])


@pytest.mark.slow
def test_pause_frees_the_worker_and_resume_finishes_from_the_checkpoint(e2e: Service) -> None:
    client = openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.new_key(f"pause-{secrets.token_hex(4)}"))
    f = client.files.create(file=("train.jsonl", chat_lines(16)), purpose="fine-tune")
    long = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        seed=3,
        hyperparameters={"n_epochs": 25, "batch_size": 4, "learning_rate_multiplier": 5.0},  # 100 steps
        metadata={"run": "long"},
        extra_body=TRAINING,
    )
    deadline = time.monotonic() + 240
    running = wait(client, long.id, {"running"})
    while progress(running)["step"] < 3 or running.estimated_finish is None:
        assert time.monotonic() < deadline and running.status == "running", running
        time.sleep(0.05)
        running = client.fine_tuning.jobs.retrieve(long.id)
    assert running.estimated_finish >= int(time.time()) - 5  # unix seconds, from the step time

    asked = client.fine_tuning.jobs.pause(long.id)
    assert asked.status in ("running", "paused")
    paused = wait(client, long.id, {"paused"}, timeout=60)
    stopped = progress(paused)["step"]
    assert 3 <= stopped < 100 and paused.estimated_finish is None and paused.metadata == {"run": "long"}
    top = client.fine_tuning.jobs.checkpoints.list(long.id, limit=1).data[0]
    assert top.step_number == stopped  # the pause's checkpoint holds every step it trained

    # The worker is free: another job runs to the end while this one stays paused.
    short = client.fine_tuning.jobs.create(
        model="tiny-llama", training_file=f.id, hyperparameters={"n_epochs": 1}, extra_body=TRAINING
    )
    assert wait(client, short.id, {"succeeded"}).status == "succeeded"
    assert client.fine_tuning.jobs.retrieve(long.id).status == "paused"

    assert client.fine_tuning.jobs.resume(long.id).status == "queued"
    done = wait(client, long.id, {"succeeded"})
    assert done.fine_tuned_model == f"ft:tiny-llama::{long.id}"
    events = list(client.fine_tuning.jobs.list_events(long.id, limit=1000))
    messages = [e.message for e in events]
    assert f"Resuming from the checkpoint at step {stopped}" in messages
    steps = sorted(e.data["step"] for e in events if e.type == "metrics" and e.data)  # type: ignore[index]
    assert steps == list(range(1, 101))  # each step once across both attempts

    # This worker has no W&B key and no MLflow server: refused at submit, naming the integration.
    for kind, settings in (("wandb", {"project": "p"}), ("mlflow", {})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.fine_tuning.jobs.create(
                model="tiny-llama",
                training_file=f.id,
                integrations=[{"type": kind, kind: settings}],  # type: ignore[misc]
            )
        assert (
            refused.value.code == "integration_unavailable" and refused.value.param == "integrations[0].type"
        )
