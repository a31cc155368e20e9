"""Pause and resume in-process (`worker.runner` on tiny-llama, a real database): a pause stops the
run at its next step with a checkpoint and ends the attempt `paused`; a resume queues it again and
the next attempt continues from that checkpoint to the same result as a run never paused."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import pytest
from sqlalchemy import select

from service import jobs, storage
from service.db.models import Artifact, Checkpoint, JobMetric
from service.db.session import session_scope
from tests.e2e.datasets import chat_lines
from tests.worker.conftest import WorkerEnv
from tests.worker.test_runner import events, explain, job_row
from worker import runner
from worker.engine.types import StepMetrics

EPOCHS = 2  # 16 examples, batch 4: 8 steps, checkpoints every 2 (tests/worker/conftest.py)
PAUSE_AT = 3  # mid-epoch, between two periodic checkpoints


def losses(job_id: str) -> dict[int, float]:
    with session_scope() as s:
        rows = s.execute(select(JobMetric.step, JobMetric.train_loss).where(JobMetric.job_id == job_id))
        return {int(step): float(loss) for step, loss in rows}


def adapter_bytes(job_id: str) -> bytes:
    with session_scope() as s:
        key = s.scalars(
            select(Artifact.storage_key).where(Artifact.job_id == job_id, Artifact.kind == "adapter")
        ).one()
    with zipfile.ZipFile(io.BytesIO(storage.default_store().get_bytes(key))) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("adapter_model.safetensors")))


def pause_at_step(monkeypatch: pytest.MonkeyPatch, tenant_id: str, at: int) -> list[int | None]:
    """Request a pause through the API's function once step `at` is reported; records the job's
    `estimated_finish` at that moment (set while running, from the measured step time)."""
    seen: list[int | None] = []
    real = runner.JobCallbacks.on_step

    def on_step(self: runner.JobCallbacks, metrics: StepMetrics) -> None:
        real(self, metrics)
        if metrics.step == at and not seen:
            self.flush()
            with session_scope() as s:
                job = jobs.request_pause(s, tenant_id=tenant_id, job_id=self.claim.job_id)
                assert job.status == "running" and job.pause_requested
                seen.append(job.estimated_finish)

    monkeypatch.setattr(runner.JobCallbacks, "on_step", on_step)
    monkeypatch.setattr(runner, "CANCEL_CACHE_SECONDS", 0.0)  # the stop is seen at the next step
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_pause_checkpoints_frees_the_worker_and_resume_ends_as_an_uninterrupted_run(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    file_id = worker_env.upload(chat_lines(16))
    hp: dict[str, Any] = {"n_epochs": EPOCHS, "batch_size": 4, "learning_rate_multiplier": 5.0}
    job_id = worker_env.create_job(file_id, hyperparameters=hp)
    with monkeypatch.context() as m:
        seen = pause_at_step(m, worker_env.tenant_id, PAUSE_AT)
        assert runner.run_claimed_job(job_id) == "paused", explain(job_id)
    job = job_row(job_id)
    stopped = job.step
    assert seen and seen[0] is not None  # the running job had an estimated finish
    assert stopped == PAUSE_AT  # stopped at the next step boundary (the stop is read every step)
    assert (job.status, job.attempt, job.paused_attempts) == ("paused", 1, 1)
    assert (job.attempt_token, job.worker_id, job.estimated_finish, job.pause_requested) == (
        None,
        None,
        None,
        False,
    )
    with session_scope() as s:
        saved = sorted(s.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))
    assert saved == [2, stopped]  # the pause's own checkpoint holds every step it trained
    assert f"Fine-tuning job paused at step {stopped}; a resume continues from its checkpoint" in [
        e.message for e in events(job_id)
    ]
    # Paused, it holds no worker: a delivery of its message claims nothing, another job runs.
    assert runner.run_claimed_job(job_id) == "skipped"
    other = worker_env.create_job(file_id, seed=7)
    assert runner.run_claimed_job(other) == "succeeded", explain(other)

    with session_scope() as s:
        assert jobs.request_resume(s, tenant_id=worker_env.tenant_id, job_id=job_id).status == "queued"
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)
    job = job_row(job_id)
    assert (job.attempt, job.paused_attempts, job.estimated_finish) == (2, 1, None)
    messages = [e.message for e in events(job_id)]
    assert f"Fine-tuning job resumed from its checkpoint at step {stopped}" in messages
    assert f"Resuming from the checkpoint at step {stopped}" in messages

    # The same job never paused: the same loss at every step and the same adapter, bit for bit.
    reference = worker_env.create_job(file_id, hyperparameters=hp)
    assert runner.run_claimed_job(reference) == "succeeded", explain(reference)
    assert losses(job_id) == losses(reference)
    assert sorted(losses(job_id)) == list(range(1, EPOCHS * 4 + 1))
    assert adapter_bytes(job_id) == adapter_bytes(reference)


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_pause_withdrawn_as_the_run_stops_requeues_it_and_a_cancel_wins(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    file_id = worker_env.upload(chat_lines(16))
    job_id = worker_env.create_job(file_id, hyperparameters={"n_epochs": EPOCHS})
    real_pause = jobs.pause

    def withdrawn_first(session: Any, *, claim: jobs.Claim, step: int) -> bool:
        # the tenant resumes between the worker's read of the pause and its transition
        jobs.request_resume(session, tenant_id=worker_env.tenant_id, job_id=claim.job_id)
        return real_pause(session, claim=claim, step=step)

    with monkeypatch.context() as m:
        pause_at_step(m, worker_env.tenant_id, 2)
        m.setattr(jobs, "pause", withdrawn_first)
        m.setattr("service.queue.enqueue_job", lambda *a, **k: True)  # no broker here
        assert runner.run_claimed_job(job_id) == "requeued", explain(job_id)
    assert job_row(job_id).status == "queued"
    messages = [e.message for e in events(job_id)]
    assert "Pause withdrawn; the job keeps running" in messages
    assert "Job re-queued: its pause was withdrawn as it stopped; it resumes from its checkpoint" in messages

    # A queued job pauses at once; a cancel ends a paused job, which then neither pauses nor resumes.
    second = worker_env.create_job(file_id, seed=5)
    with session_scope() as s:
        assert jobs.request_pause(s, tenant_id=worker_env.tenant_id, job_id=second).status == "paused"
        assert jobs.request_cancel(s, tenant_id=worker_env.tenant_id, job_id=second).status == "cancelled"
        with pytest.raises(jobs.InvalidRequestError, match="cannot be paused"):
            jobs.request_pause(s, tenant_id=worker_env.tenant_id, job_id=second)
        with pytest.raises(jobs.InvalidRequestError, match="cannot be resumed"):
            jobs.request_resume(s, tenant_id=worker_env.tenant_id, job_id=second)


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_lost_worker_s_job_with_a_pause_requested_ends_paused_and_pauses_are_not_retries(
    worker_env: WorkerEnv,
) -> None:
    """The reaper's release of a silent attempt (`jobs.requeue`) reaches a requested pause instead
    of re-queueing; the retry count the reaper compares with LORAQ_MAX_ATTEMPTS leaves out the
    attempts that ended in a pause."""
    job_id = worker_env.create_job(worker_env.upload(chat_lines(8)))
    tenant = worker_env.tenant_id
    for attempt in (1, 2):  # two attempts, each paused by its worker
        with session_scope() as s:
            claim = jobs.claim(s, job_id=job_id, worker_id="w")
            assert claim is not None and (claim.attempt, claim.paused_attempts) == (attempt, attempt - 1)
            jobs.request_pause(s, tenant_id=tenant, job_id=job_id)
            assert jobs.pause(s, claim=claim, step=0)
            jobs.request_resume(s, tenant_id=tenant, job_id=job_id)
    with session_scope() as s:
        claim = jobs.claim(s, job_id=job_id, worker_id="w")
        assert claim is not None and claim.attempt == 3
        ((_, token, retries),) = jobs.stale_running_jobs(s, older_than=float("inf"))
        assert (token, retries) == (claim.attempt_token, 1)  # attempt 3, the first not paused
        jobs.request_pause(s, tenant_id=tenant, job_id=job_id)
        # the worker went silent before it reached the pause: released as paused, nothing to re-send
        assert not jobs.requeue(s, job_id=job_id, attempt_token=claim.attempt_token, reason="worker lost")
    job = job_row(job_id)
    assert (job.status, job.attempt_token, job.pause_requested) == ("paused", None, False)
    assert "Fine-tuning job paused: worker lost" in [e.message for e in events(job_id)]
