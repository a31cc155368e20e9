"""The job state machine on a real database: fenced transitions, duplicate claims, stale attempt
tokens, metric de-duplication, checkpoints for resume, cancellation and finishing."""

from __future__ import annotations

import time
from typing import Any

import pytest
from sqlalchemy import func, select

from service import files, jobs, storage
from service.db.models import Artifact, File, Job, JobEvent, JobMetric
from service.db.session import session_scope
from service.errors import InvalidRequestError, NotFoundError
from service.schemas import JobCreate, StoredCheckpointMetrics
from tests.conftest import DATASET, LoraqEnv, job_body, make_tenant_key, store_file
from worker.engine.types import StepMetrics


def add_file(tenant_id: str, purpose: str = "fine-tune") -> tuple[str, str]:
    file_id = store_file(tenant_id, DATASET, "d.jsonl", purpose)
    return file_id, storage.file_key(tenant_id, file_id)


def new_job(tenant_id: str, file_id: str, **spec: Any) -> str:
    with session_scope() as s:
        return jobs.create_job(s, tenant_id=tenant_id, spec=JobCreate(**job_body(file_id, **spec))).id


def step(n: int, total: int = 10, loss: float = 2.0) -> StepMetrics:
    return StepMetrics(
        step=n,
        total_steps=total,
        epoch=n / total,
        train_loss=loss,
        lr=1e-4,
        grad_norm=0.5,
        tokens=100,
        trained_tokens=100 * n,
        tokens_per_s=1000.0,
        step_seconds=0.1,
        eta_seconds=float(total - n),
    )


def claim(job_id: str, worker: str = "w1") -> jobs.Claim | None:
    with session_scope() as s:
        return jobs.claim(s, job_id=job_id, worker_id=worker)


def status_of(job_id: str) -> str:
    with session_scope() as s:
        return str(s.scalar(select(Job.status).where(Job.id == job_id)))


@pytest.fixture
def tenant(loraq_env: LoraqEnv) -> str:
    return make_tenant_key()[0]


def test_create_job_queues_and_claim_carries_what_the_worker_needs(tenant: str) -> None:
    file_id, key = add_file(tenant)
    job_id = new_job(
        tenant,
        file_id,
        hyperparameters={"n_epochs": 2, "batch_size": "auto"},
        lora={"r": 8},
        validation_file=file_id,
    )
    assert status_of(job_id) == "queued"
    c = claim(job_id)
    assert c is not None
    assert (c.job_id, c.tenant_id, c.attempt, c.model) == (job_id, tenant, 1, "tiny-llama")
    assert c.training_file == key and c.validation_file == key
    assert storage.default_store().get_bytes(c.training_file) == DATASET
    # validation_split 0: the job has a validation file, so nothing is held out of training
    t = c.training
    # "auto" travels as requested: the engine plans it from the tokenized data (plan_auto)
    assert (t.n_epochs, t.batch_size, t.learning_rate_multiplier, t.validation_split) == (
        2,
        "auto",
        "auto",
        0.0,
    )
    assert t.lora.r == 8 and t.lora.alpha == 32.0 and t.lora.target_modules == "all-linear"
    assert (t.seed, t.max_seq_len, c.suffix, c.resume_checkpoint) == (1, 64, "t", None)
    assert len(c.attempt_token) == 32
    with session_scope() as s:
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert job.status == "running" and job.worker_id == "w1" and job.started_at is not None
        assert job.hyperparameters["batch_size"] == "auto" and job.plan is None  # until the engine plans
        # the engine's plan (its first event's data) is stored and shown from then on
        planned = {"n_epochs": 2, "batch_size": 1, "learning_rate_multiplier": 1.0}
        assert jobs.record_plan(
            s, claim=c, plan={"hyperparameters": planned, "row_tokens": 128, "message": "m"}
        )
    with session_scope() as s:
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert job.plan is not None and job.plan["hyperparameters"] == planned
        assert job.hyperparameters["batch_size"] == "auto"  # the request itself is kept


def test_duplicate_claim_returns_none(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    first = claim(job_id, "w1")
    assert first is not None
    assert claim(job_id, "w2") is None
    with session_scope() as s:
        assert s.scalar(select(Job.worker_id).where(Job.id == job_id)) == "w1"


def test_create_job_rejects_unknown_model_and_files_naming_the_param(tenant: str) -> None:
    file_id, _ = add_file(tenant)
    results_file, _ = add_file(tenant, purpose="fine-tune-results")
    other_tenant = make_tenant_key()[0]
    foreign_file, _ = add_file(other_tenant)
    cases = [
        ({"model": "no-such-model"}, "model"),
        ({"training_file": "file-missing"}, "training_file"),
        ({"training_file": foreign_file}, "training_file"),  # another tenant's file does not exist here
        ({"training_file": results_file}, "training_file"),
        ({"validation_file": "file-missing"}, "validation_file"),
    ]
    for override, param in cases:
        with pytest.raises((InvalidRequestError, NotFoundError)) as err, session_scope() as s:
            jobs.create_job(s, tenant_id=tenant, spec=JobCreate(**{**job_body(file_id), **override}))
        # a wrong purpose is a bad request; a name that matches nothing is a 404
        assert err.value.status == (400 if override.get("training_file") == results_file else 404)
        assert err.value.param == param


def test_stale_attempt_is_fenced_out_after_requeue(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    old = claim(job_id, "w-old")
    assert old is not None
    with session_scope() as s:
        jobs.record_metrics(s, claim=old, rows=[step(1), step(2)])
    # The old worker went silent: the reaper re-queues, a new worker claims attempt 2.
    with session_scope() as s:
        assert jobs.requeue(s, job_id=job_id, attempt_token=old.attempt_token, reason="heartbeat lost")
    new = claim(job_id, "w-new")
    assert new is not None and new.attempt == 2 and new.attempt_token != old.attempt_token

    with session_scope() as s:
        assert jobs.heartbeat(s, claim=old) is False
    with pytest.raises(jobs.StaleAttemptError), session_scope() as s:
        jobs.record_metrics(s, claim=old, rows=[step(3, loss=99.0)])
    with pytest.raises(jobs.StaleAttemptError), session_scope() as s:
        jobs.register_checkpoint(
            s, claim=old, step=3, storage_key="x", sha256="0" * 64, metrics=StoredCheckpointMetrics(step=3)
        )
    with session_scope() as s:
        assert jobs.finish(s, claim=old, status="succeeded", fine_tuned_model="ft:x") is False
        assert jobs.requeue(s, job_id=job_id, attempt_token=old.attempt_token, reason="again") is False

    with session_scope() as s:
        assert jobs.heartbeat(s, claim=new) is True
        jobs.record_metrics(s, claim=new, rows=[step(2), step(3)])  # step 2 repeats after resume
        assert jobs.finish(s, claim=new, status="succeeded", trained_tokens=300, fine_tuned_model="ft:m")
    with session_scope() as s:
        rows = jobs.metric_rows(s, job_id=job_id)
        assert [r.step for r in rows] == [1, 2, 3]
        assert all(r.train_loss == 2.0 for r in rows)  # the stale write of step 3 never landed
        n_metric_events = s.scalar(
            select(func.count())
            .select_from(JobEvent)
            .where(JobEvent.job_id == job_id, JobEvent.type == "metrics")
        )
        assert n_metric_events == 3
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert (job.status, job.trained_tokens, job.fine_tuned_model) == ("succeeded", 300, "ft:m")
        assert job.finished_at is not None
    # A finished job's attempt can write nothing more.
    with pytest.raises(jobs.StaleAttemptError), session_scope() as s:
        jobs.record_metrics(s, claim=new, rows=[step(4)])


def test_record_metrics_updates_progress_and_writes_metric_events(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    before = time.time()
    with session_scope() as s:
        jobs.record_metrics(s, claim=c, rows=[step(1, loss=3.0), step(2, loss=2.5), step(2, loss=2.4)])
        jobs.record_metrics(s, claim=c, rows=[])
    with session_scope() as s:
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert (job.step, job.total_steps, job.train_loss, job.trained_tokens) == (2, 10, 2.4, 200)
        assert job.estimated_finish is not None and job.estimated_finish >= int(before)
        assert job.heartbeat_at is not None and job.heartbeat_at >= before
        events, _ = jobs.list_events(s, tenant_id=tenant, job_id=job_id, after=None, limit=100)
        data = [e.data for e in events if e.type == "metrics"]
        assert [d["step"] for d in data if d] == [2, 1]  # newest first
        assert data[0] is not None and data[0]["train_loss"] == 2.4 and data[0]["total_steps"] == 10
        assert s.scalar(select(func.count()).select_from(JobMetric).where(JobMetric.job_id == job_id)) == 2


def test_checkpoint_becomes_the_resume_point_of_the_next_attempt(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    with session_scope() as s:
        for step, key in ((2, "jobs/a/2.zip"), (4, "jobs/a/4.zip"), (4, "jobs/a/4b.zip")):
            metrics = StoredCheckpointMetrics(step=step)
            jobs.register_checkpoint(s, claim=c, step=step, storage_key=key, sha256="a" * 64, metrics=metrics)
        assert jobs.requeue(s, job_id=job_id, attempt_token=c.attempt_token, reason="worker lost")
    again = claim(job_id)
    assert again is not None and again.resume_checkpoint == "jobs/a/4b.zip"
    with session_scope() as s:
        ckpts, more = jobs.list_checkpoints(s, tenant_id=tenant, job_id=job_id, after=None, limit=10)
        assert [ck.step for ck in ckpts] == [4, 2] and not more


def test_cancel_queued_job_is_immediate_and_cannot_be_claimed(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    with session_scope() as s:
        job = jobs.request_cancel(s, tenant_id=tenant, job_id=job_id)
        assert job.status == "cancelled" and job.finished_at is not None
    assert claim(job_id) is None
    with session_scope() as s:  # cancelling again is harmless
        assert jobs.request_cancel(s, tenant_id=tenant, job_id=job_id).status == "cancelled"


def test_cancel_running_job_is_cooperative(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    with session_scope() as s:
        assert jobs.is_cancel_requested(s, job_id=job_id) is False
        job = jobs.request_cancel(s, tenant_id=tenant, job_id=job_id)
        assert job.status == "running" and job.cancel_requested
    with session_scope() as s:
        assert jobs.is_cancel_requested(s, job_id=job_id) is True
        assert jobs.heartbeat(s, claim=c) is True  # the worker keeps its claim until it stops
        jobs.record_metrics(s, claim=c, rows=[step(1)])
        assert jobs.finish(s, claim=c, status="cancelled", trained_tokens=100)
    with session_scope() as s:
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert job.status == "cancelled" and job.fine_tuned_model is None
        assert [r.step for r in jobs.metric_rows(s, job_id=job_id)] == [1]  # partial metrics kept
        with pytest.raises(ValueError, match="finish status"):
            jobs.finish(s, claim=c, status="queued")


def test_cancel_finished_job_is_refused_and_other_tenant_gets_404(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    with session_scope() as s:
        assert jobs.finish(s, claim=c, status="failed", error={"code": "x", "message": "boom", "param": None})
    with pytest.raises(InvalidRequestError), session_scope() as s:
        jobs.request_cancel(s, tenant_id=tenant, job_id=job_id)
    other = make_tenant_key()[0]
    with pytest.raises(NotFoundError), session_scope() as s:
        jobs.request_cancel(s, tenant_id=other, job_id=job_id)


def test_finish_records_adapter_and_results_artifacts(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    adapter = storage.put_bytes(f"jobs/{job_id}/adapter.zip", b"PK-not-really")
    with session_scope() as s:
        results = files.create_file_from_bytes(
            s, tenant_id=tenant, filename="r.csv", purpose="fine-tune-results", content=b"step\n1\n"
        )
        assert jobs.finish(
            s,
            claim=c,
            status="succeeded",
            trained_tokens=10,
            adapter_key=adapter.key,
            adapter_sha256=adapter.sha256,
            result_file_id=results.id,
            fine_tuned_model=f"ft:tiny-llama:t:{job_id}",
        )
    with session_scope() as s:
        art = jobs.get_adapter(s, tenant_id=tenant, job_id=job_id)
        assert (art.sha256, art.bytes) == (adapter.sha256, len(b"PK-not-really"))
        kinds = set(s.scalars(select(Artifact.kind).where(Artifact.job_id == job_id)))
        assert kinds == {"adapter", "results"}
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert job.result_files == [results.id]
        assert jobs.succeeded_models(s, tenant_id=tenant) == [(f"ft:tiny-llama:t:{job_id}", job.finished_at)]


def test_stale_running_jobs_and_fail_stale(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    with session_scope() as s:
        stale = jobs.stale_running_jobs(s, older_than=time.time() + 1)
        assert (job_id, c.attempt_token, 1) in stale
        assert job_id not in [j for j, _, _ in jobs.stale_running_jobs(s, older_than=time.time() - 60)]
        assert jobs.fail_stale(s, job_id=job_id, attempt_token=c.attempt_token, reason="worker lost 3 times")
    with session_scope() as s:
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert job.status == "failed" and job.error is not None and job.error["code"] == "worker_lost"


def test_claim_fails_a_job_whose_file_vanished(tenant: str) -> None:
    file_id, _ = add_file(tenant)
    job_id = new_job(tenant, file_id)
    with session_scope() as s:  # what a delete racing job creation would leave behind
        s.delete(s.scalars(select(File).where(File.id == file_id)).one())
    assert claim(job_id) is None
    with session_scope() as s:
        job = jobs.get_job(s, tenant_id=tenant, job_id=job_id)
        assert job.status == "failed" and job.error is not None
        assert job.error["param"] == "training_file" and file_id in job.error["message"]


def test_concurrent_requests_with_one_idempotency_key_make_one_job(tenant: str) -> None:
    import threading

    file_id, _ = add_file(tenant)
    barrier = threading.Barrier(4)
    ids: list[str] = []
    errors: list[BaseException] = []

    def submit() -> None:
        try:
            with session_scope() as s:
                barrier.wait()
                job = jobs.create_job(
                    s, tenant_id=tenant, spec=JobCreate(**job_body(file_id)), idempotency_key="same-key"
                )
                ids.append(job.id)
        except BaseException as e:  # reported below; a thread's exception would vanish
            errors.append(e)

    threads = [threading.Thread(target=submit) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert len(ids) == 4 and len(set(ids)) == 1
    with session_scope() as s:
        n = s.scalar(select(func.count()).select_from(Job).where(Job.tenant_id == tenant))
        assert n == 1
        assert jobs.get_job(s, tenant_id=tenant, job_id=ids[0]).status == "queued"


def test_non_finite_metrics_are_stored_without_breaking_json(tenant: str) -> None:
    job_id = new_job(tenant, add_file(tenant)[0])
    c = claim(job_id)
    assert c is not None
    # The engine stops on a non-finite training loss or gradient norm before reporting the step;
    # a NaN validation loss or an infinite ETA (no throughput yet) can still arrive.
    bad = step(1, loss=2.0)
    bad.valid_loss = float("nan")
    bad.eta_seconds = float("inf")
    with session_scope() as s:
        jobs.record_metrics(s, claim=c, rows=[bad, step(2, loss=1.5)])
    with session_scope() as s:
        events, _ = jobs.list_events(s, tenant_id=tenant, job_id=job_id, after=None, limit=10)
        data = {e.data["step"]: e.data for e in events if e.type == "metrics" and e.data}
        assert data[1]["valid_loss"] is None and data[1]["eta_seconds"] is None
        assert data[1]["train_loss"] == 2.0 and data[2]["train_loss"] == 1.5
        assert [r.step for r in jobs.metric_rows(s, job_id=job_id)] == [1, 2]
