"""`make up`'s layout on a disk that fills up mid-job: SQLite, the store, the model store, the
worker's scratch space and its metric files all under one data dir, on a real 96 MiB filesystem
(tests/small_fs.py), with a real uvicorn API and a real Celery worker training tiny-llama.

The disk is filled once the job registered a checkpoint: the next checkpoint, the job's rows and
its heartbeat all fail to be written. The worker lives on (it used to die of SIGBUS in its metric
files), the API answers uploads 507 and reads as before; once space is freed the job resumes from
its last checkpoint and succeeds, with no process restarted."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.datasets import chat_lines
from tests.e2e.procs import clean_env, free_port, stop_process, wait_for
from tests.reliability.conftest import Stack
from tests.servers import shared_redis_url
from tests.small_fs import SmallFs, small_fs

EPOCHS = 30  # 16 examples, batch 4: 120 steps; a checkpoint every 3


@pytest.fixture
def stack_on_small_disk(tmp_path: Path) -> Iterator[tuple[Stack, SmallFs]]:
    import redis

    from service.db.migrate import upgrade_head

    with small_fs(96) as fs:
        data_dir = fs.root / "var"
        data_dir.mkdir()
        db_url = f"sqlite:///{data_dir / 'loraq.db'}"
        api_port = free_port()
        env = clean_env(
            LORAQ_DATA_DIR=str(data_dir),
            LORAQ_DATABASE_URL=db_url,
            LORAQ_REDIS_URL=shared_redis_url(),
            LORAQ_PORT=str(api_port),
            LORAQ_WORKER_QUEUE=f"disk-{secrets.token_hex(4)}",
            LORAQ_SECRET_KEY=secrets.token_hex(32),
            LORAQ_CHECKPOINT_EVERY="3",
            LORAQ_CHECKPOINT_EACH_EPOCH="0",
            LORAQ_HEARTBEAT_SECONDS="0.5",
            LORAQ_HEARTBEAT_TIMEOUT_SECONDS="5",
            LORAQ_REAPER_INTERVAL_SECONDS="0.5",
            LORAQ_RECONCILE_GRACE_SECONDS="1",
            # more than a failed attempt frees (its scratch space): the job waits for the operator
            LORAQ_MIN_FREE_DISK_BYTES=str(16 << 20),
            LORAQ_RATE_LIMIT_PER_MINUTE="0",
        )
        stack = Stack(
            url=f"http://127.0.0.1:{api_port}", key="", env=env, db_url=db_url, tmp=tmp_path, redis_port=0
        )
        upgrade_head(db_url)
        try:
            stack.start_api("disk")
            yield stack, fs
        finally:
            fs.unfill()
            for proc, _ in stack.workers:
                stop_process(proc, grace=10)
            if stack.api is not None:
                stop_process(stack.api)
            from service.db.session import dispose_engines

            dispose_engines()
            client = redis.Redis.from_url(shared_redis_url())
            client.delete(env["LORAQ_WORKER_QUEUE"])
            client.close()


# Alone when the suite runs on several workers (tests/parallel.py): the disk stays full for
# seconds while heartbeats go stale against a 5 s timeout; beside other tests' load the reaper
# re-queued the job more often.
@pytest.mark.serial
def test_disk_full_mid_job_the_worker_lives_and_the_job_resumes(
    stack_on_small_disk: tuple[Stack, SmallFs],
) -> None:
    stack, fs = stack_on_small_disk
    worker = stack.start_worker()
    job_id = stack.submit(EPOCHS)
    saved = stack.wait_checkpoint(job_id)
    fs.fill()

    # The attempt fails on the full disk, and the retried delivery finds too little space to claim
    # anything; meanwhile the worker stays up and the API still reads.
    def refused_to_claim() -> bool:
        assert stack.job(job_id)["status"] in {"running", "queued"}
        return "no job claimed" in stack.worker_log(worker)

    wait_for(refused_to_claim, "the worker refusing to claim on a full disk", 60, worker)
    time.sleep(1)  # and some more of it
    assert worker.poll() is None, f"the worker died ({worker.returncode})\n{stack.logs()}"
    fs.fill()  # again: the failed attempt freed its scratch space
    with stack.client() as c:
        r = c.post("/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", chat_lines(4))})
        assert r.status_code == 507 and r.json()["error"]["code"] == "disk_full", r.text
    last = max(stack.metric_steps(job_id), default=0)
    assert last < EPOCHS * 4, "the job ended before the disk filled; make it longer"

    fs.unfill()
    job = stack.assert_succeeded_once(job_id)
    # Attempt 1 fails on the full disk and a resumed one succeeds. One more attempt between them is
    # timing, not a fault: the full disk also stops heartbeats (the reaper may release an attempt
    # whose heartbeat went stale), and a retried delivery may claim in the moment between the
    # failed attempt freeing its scratch space and the refill above (CI saw attempt 3 while this
    # test ran alone). What must hold either way: the worker was never restarted (below) and no
    # step or artifact was stored twice (assert_succeeded_once).
    started = [e for e in stack.events(job_id) if "job started (attempt" in e]
    assert 2 <= len(started) <= 3, started
    assert worker.poll() is None and stack.alive_workers() == [worker]
    resumed = [e for e in stack.events(job_id) if e.startswith("Resuming from the checkpoint at step")]
    assert resumed and int(resumed[-1].rsplit(" ", 1)[1]) >= saved, stack.events(job_id)
    assert job["status"] == "succeeded"
