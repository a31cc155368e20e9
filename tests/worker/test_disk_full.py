"""A worker whose disk fills up: the job keeps its last good checkpoint, goes back to the queue,
waits there while the disk is full and resumes once space is freed; on its last attempt it fails
with code `disk_full`. The metric files the worker maps never turn a full disk into SIGBUS.

The data dir is a real small filesystem (tests/small_fs.py), filled by a ballast file at a chosen
moment of a real tiny-llama run (`worker.runner` in-process): after a checkpoint is registered
(the next one fails), after the last one (the adapter's export fails), or once the adapter is
exported (storing its zip fails)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select

from service import storage
from service.db.models import Checkpoint, JobMetric
from service.db.session import session_scope
from tests.e2e.datasets import chat_lines
from tests.servers import shared_redis_url
from tests.small_fs import SmallFs, small_fs
from tests.worker.conftest import WorkerEnv
from tests.worker.test_runner import events, explain, job_row, sha256_of
from worker import runner
from worker.engine.types import CheckpointInfo

STEPS = 8  # 16 examples, batch 4, 2 epochs; a checkpoint every 2 steps (worker_env)
MIN_FREE = 4 << 20


@pytest.fixture
def disk(worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[SmallFs]:
    """worker_env's data dir on a 64 MiB filesystem; re-queues reach a queue of this test's own."""
    import redis

    from service.settings import get_settings

    queue = f"test-{secrets.token_hex(4)}"
    with small_fs(64) as fs:
        monkeypatch.setenv("LORAQ_DATA_DIR", str(fs.root / "var"))
        monkeypatch.setenv("LORAQ_REDIS_URL", shared_redis_url())
        monkeypatch.setenv("LORAQ_WORKER_QUEUE", queue)
        monkeypatch.setenv("LORAQ_MIN_FREE_DISK_BYTES", str(MIN_FREE))
        get_settings.cache_clear()
        try:
            yield fs
        finally:
            get_settings.cache_clear()
            client = redis.Redis.from_url(shared_redis_url())
            client.delete(queue)
            client.close()


def fill_when(monkeypatch: pytest.MonkeyPatch, fs: SmallFs, *, step: int | None, event: str | None) -> None:
    """Fill the disk once the checkpoint of `step` is registered, or once `event` is said, the
    first time only (the attempt that resumes passes there again)."""
    on_checkpoint, on_event = runner.JobCallbacks.on_checkpoint, runner.JobCallbacks.on_event
    filled: list[bool] = []

    def fill_once() -> None:
        if not filled:
            filled.append(True)
            fs.fill()

    def checkpointed(self: runner.JobCallbacks, checkpoint: CheckpointInfo) -> None:
        on_checkpoint(self, checkpoint)
        if checkpoint.step == step:
            fill_once()

    def said(self: runner.JobCallbacks, level: Any, message: str, data: Any = None) -> None:
        on_event(self, level, message, data)
        if event is not None and message.startswith(event):
            fill_once()

    monkeypatch.setattr(runner.JobCallbacks, "on_checkpoint", checkpointed)
    monkeypatch.setattr(runner.JobCallbacks, "on_event", said)


def new_job(worker_env: WorkerEnv) -> str:
    hyperparameters = {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5.0}
    return worker_env.create_job(worker_env.upload(chat_lines(16)), hyperparameters=hyperparameters)


def checkpoints(job_id: str) -> list[Checkpoint]:
    with session_scope() as s:
        query = select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step)
        return list(s.scalars(query))


def assert_nothing_partial(fs: SmallFs, job_id: str) -> None:
    """On the disk: no temp file or directory, no scratch space of the attempt, and of the job's
    objects in the store exactly its registered checkpoints and their manifests, each whole."""
    files = fs.files()
    temporary = [f for f in files if f.endswith(".part") or "/." in f or f.startswith("var/store/tmp")]
    assert temporary == [], temporary
    assert [f for f in files if f.startswith("var/jobs/")] == []
    job_objects = {f for f in files if f.startswith(f"var/store/jobs/{job_id}/")}
    keys = [k for c in checkpoints(job_id) for k in (c.storage_key, storage.manifest_key(c.storage_key))]
    assert job_objects == {f"var/store/{k}" for k in keys}
    for c in checkpoints(job_id):
        assert c.sha256 == sha256_of(c.storage_key)


# (fill after the checkpoint of this step, or once this event is said; the step it resumes from)
WHEN = {
    "checkpoint": (2, None, 2),  # the checkpoint of step 4 fails
    "export": (STEPS, None, STEPS),  # the adapter's export after the last checkpoint fails
    "store": (None, "Adapter exported", STEPS),  # storing the exported adapter's zip fails
}


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
@pytest.mark.parametrize("when", list(WHEN))
def test_a_full_disk_requeues_the_job_which_waits_then_resumes_from_its_checkpoint(
    worker_env: WorkerEnv, disk: SmallFs, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    step, event, kept = WHEN[when]
    job_id = new_job(worker_env)
    fill_when(monkeypatch, disk, step=step, event=event)

    assert runner.run_claimed_job(job_id) == "requeued", explain(job_id)
    job = job_row(job_id)
    assert (job.status, job.attempt, job.error) == ("queued", 1, None)
    said = f"the worker ran out of disk space (attempt 1 of 3); its checkpoint at step {kept} is kept"
    assert f"Job re-queued: {said}; it resumes from step {kept} once a worker has space" in [
        e.message for e in events(job_id)
    ]
    assert checkpoints(job_id)[-1].step == kept
    assert_nothing_partial(disk, job_id)

    # Still full: this worker claims nothing, and the job says what it waits for.
    assert runner.run_claimed_job(job_id) == "skipped"
    job = job_row(job_id)
    assert (job.status, job.attempt) == ("queued", 1)
    assert job.waiting_for is not None and job.waiting_for.startswith("disk space on worker"), job.waiting_for

    disk.unfill()
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)
    assert job_row(job_id).attempt == 2
    assert f"Resuming from the checkpoint at step {kept}" in [e.message for e in events(job_id)]
    with session_scope() as s:
        steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)))
    assert steps == list(range(1, STEPS + 1))


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_full_disk_on_the_last_attempt_fails_the_job_with_disk_full(
    worker_env: WorkerEnv, disk: SmallFs, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_MAX_ATTEMPTS", "1")
    get_settings.cache_clear()
    job_id = new_job(worker_env)
    fill_when(monkeypatch, disk, step=2, event=None)

    assert runner.run_claimed_job(job_id) == "failed", explain(job_id)
    job = job_row(job_id)
    assert job.status == "failed" and job.error == {
        "code": "disk_full",
        "message": "the worker ran out of disk space (attempt 1 of 1); its checkpoint at step 2 is kept; "
        "free disk space, then submit the job again",
        "param": None,
    }
    assert [c.step for c in checkpoints(job_id)] == [2]
    assert_nothing_partial(disk, job_id)
    assert storage.default_store().exists(checkpoints(job_id)[0].storage_key)


METRICS_CHILD = """
import sys
from pathlib import Path
from prometheus_client import Counter, mmap_dict, values
from worker.metrics.training import prepare_multiprocess_dir

prepare_multiprocess_dir(Path(sys.argv[1]))
if sys.argv[2] == "stock":
    values.MmapedDict = mmap_dict.MmapedDict  # prometheus_client's own, as shipped
finished = Counter("loraq_jobs_finished", "Job attempts finished, by outcome", ["outcome"])
finished.labels("succeeded").inc()
print("mapped", flush=True)
sys.stdin.readline()  # the disk is full now
refused = 0
for i in range(2000):  # new series: their keys need new pages of the mapped file
    try:
        finished.labels(f"outcome-{i:04d}").inc()
    except OSError:
        refused += 1
finished.labels("succeeded").inc()  # a series that exists still counts
print("refused", refused, flush=True)
"""


def test_metric_files_on_a_full_disk_raise_enospc_instead_of_sigbus() -> None:
    """prometheus_client's sparse mapped files are what killed a worker with SIGBUS on a full disk;
    the worker's (worker/metrics/allocated_mmap.py) make it an OSError and the process lives on."""
    with small_fs(2) as fs:
        for variant in ("stock", "allocated"):
            directory = fs.root / variant
            child = subprocess.Popen(
                [sys.executable, "-c", METRICS_CHILD, str(directory), variant],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert child.stdout is not None and child.stdout.readline() == "mapped\n", child.stderr
            fs.fill()
            out, err = child.communicate("go\n", timeout=60)
            fs.unfill()
            if variant == "stock":
                assert child.returncode == -signal.SIGBUS, (child.returncode, out, err)
            else:
                assert child.returncode == 0, err
                refused = int(out.split()[-1])
                assert 0 < refused < 2000, out


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_checkpoint_is_registered_only_after_every_step_before_it_is_stored(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database refuses the metric rows of steps 1-4 until the checkpoint of step 4 has been
    taken (SQLite's journal on a full disk, while the checkpoint's small row and zip still fit: seen
    in the stack test on a real small disk). Registered, that checkpoint would be where a later
    attempt resumes, and those steps would never be stored. It is not registered; the run goes on,
    the rows are stored at the next flush, and every checkpoint that is registered has every step
    before it stored."""
    from sqlalchemy.exc import OperationalError

    from service import jobs

    record, register, on_checkpoint = (
        jobs.record_metrics,
        jobs.register_checkpoint,
        runner.JobCallbacks.on_checkpoint,
    )
    past_step_4: list[bool] = []
    refused: list[list[int]] = []
    stored_at: dict[int, set[int]] = {}

    def record_metrics(session: Any, *, claim: Any, rows: list[Any]) -> Any:
        if not past_step_4 and any(m.step <= 4 for m in rows):
            refused.append([m.step for m in rows])
            raise OperationalError("INSERT INTO job_metrics", {}, Exception("database or disk is full"))
        return record(session, claim=claim, rows=rows)

    def register_checkpoint(session: Any, *, claim: Any, step: int, **kw: Any) -> Any:
        stored_at[step] = set(session.scalars(select(JobMetric.step).where(JobMetric.job_id == claim.job_id)))
        return register(session, claim=claim, step=step, **kw)

    def checkpointed(self: runner.JobCallbacks, checkpoint: CheckpointInfo) -> None:
        on_checkpoint(self, checkpoint)
        if checkpoint.step == 4:
            past_step_4.append(True)

    monkeypatch.setattr(jobs, "record_metrics", record_metrics)
    monkeypatch.setattr(jobs, "register_checkpoint", register_checkpoint)
    monkeypatch.setattr(runner.JobCallbacks, "on_checkpoint", checkpointed)
    job_id = new_job(worker_env)
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)

    assert refused and past_step_4
    assert sorted(stored_at) == [6, 8]  # 2 and 4 came while their steps were refused
    for step, stored in stored_at.items():
        assert set(range(1, step + 1)) <= stored, (step, sorted(stored))
    with session_scope() as s:
        steps = sorted(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)))
    assert steps == list(range(1, STEPS + 1))
