"""The reaper + reconciler (service/reaper.py) on SQLite and PostgreSQL with the local Redis.

Each test has a database of its own (a tick looks at every job in it) and a Celery queue name of
its own in Redis (deleted afterwards).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import select, update

from service import jobs
from service.db.models import Job, JobEvent
from service.db.session import session_scope
from service.queue import enqueue_job, enqueue_join
from service.reaper import Reaper, held_job_ids, message_job_id
from service.schemas import JobCreate
from tests.conftest import DATASET, job_body, store_file
from tests.servers import create_pg_database, drop_pg_database, shared_redis_url

TIMEOUT = 30.0  # heartbeat_timeout_seconds in these tests


@dataclass
class Env:
    tenant_id: str
    queue: str
    redis: redis.Redis

    def new_job(self, *, send: bool = True) -> str:
        """A queued job; `send`: its wake-up sent after commit, as POST /v1/fine_tuning/jobs does."""
        file_id = store_file(self.tenant_id, DATASET, "d.jsonl")
        with session_scope() as s:
            job_id = jobs.create_job(s, tenant_id=self.tenant_id, spec=JobCreate(**job_body(file_id))).id
        if send:
            assert enqueue_job(job_id)
        return job_id

    def claim(self, job_id: str, *, heartbeat_age: float = 0.0) -> jobs.Claim:
        with session_scope() as s:
            c = jobs.claim(s, job_id=job_id, worker_id="w1")
        assert c is not None
        if heartbeat_age:
            with session_scope() as s:
                stale = time.time() - heartbeat_age
                s.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=stale))
        return c

    def job(self, job_id: str) -> Job:
        with session_scope() as s:
            return jobs.get_job(s, tenant_id=self.tenant_id, job_id=job_id)

    def messages(self) -> list[str | None]:
        return [message_job_id(m) for m in self.redis.lrange(self.queue, 0, -1)]


@pytest.fixture(params=["sqlite", "postgresql"])
def env(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    from service.auth import get_or_create_tenant
    from service.db.migrate import upgrade_head
    from service.db.session import dispose_engines
    from service.settings import get_settings

    pg_name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'loraq.db'}"
    else:
        pg_name, url = create_pg_database("loraq_reaper")
    queue = f"test-reaper-{secrets.token_hex(4)}"
    for name, value in {
        "DATA_DIR": str(tmp_path / "var"),
        "DATABASE_URL": url,
        "REDIS_URL": shared_redis_url(),
        "WORKER_QUEUE": queue,
        "HEARTBEAT_TIMEOUT_SECONDS": str(TIMEOUT),
        "MAX_ATTEMPTS": "2",
        "RECONCILE_GRACE_SECONDS": "5",
        "REAPER_INTERVAL_SECONDS": "0",
    }.items():
        monkeypatch.setenv(f"LORAQ_{name}", value)
    get_settings.cache_clear()
    upgrade_head(url)
    with session_scope() as s:
        tenant_id = get_or_create_tenant(s, "reaper-tests").id
    client = redis.Redis.from_url(shared_redis_url())
    try:
        yield Env(tenant_id=tenant_id, queue=queue, redis=client)
    finally:
        client.delete(queue)
        client.close()
        dispose_engines()
        get_settings.cache_clear()
        if pg_name:
            drop_pg_database(pg_name)


def test_silent_worker_job_is_requeued_and_resent_and_the_old_attempt_fenced(env: Env) -> None:
    job_id = env.new_job()
    env.redis.delete(env.queue)  # the worker (now silent) took the message
    old = env.claim(job_id, heartbeat_age=TIMEOUT + 1)
    reaper = Reaper()
    result = reaper.tick()
    assert result.requeued == [job_id] and result.failed == []
    job = env.job(job_id)
    assert (job.status, job.attempt_token, job.worker_id) == ("queued", None, None)
    assert env.messages() == [job_id]  # sent again, to the job's own queue
    with session_scope() as s:
        assert jobs.heartbeat(s, claim=old) is False  # the silent worker's writes are refused
        events = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))
    assert any("no heartbeat for 30s (attempt 1 of 2)" in m for m in events), events
    # the next attempt claims it as attempt 2 and the message is not sent a second time
    new = env.claim(job_id)
    assert new.attempt == 2
    assert reaper.tick().requeued == []


def test_job_out_of_attempts_fails_with_the_reason(env: Env) -> None:
    job_id = env.new_job()
    env.claim(job_id, heartbeat_age=TIMEOUT + 1)
    reaper = Reaper()
    assert reaper.tick().requeued == [job_id]
    env.redis.delete(env.queue)
    env.claim(job_id, heartbeat_age=TIMEOUT + 1)  # attempt 2 of 2 goes silent too
    result = reaper.tick()
    assert result.failed == [job_id] and result.requeued == []
    job = env.job(job_id)
    assert job.status == "failed" and job.error is not None
    assert job.error["code"] == "worker_lost"
    assert "attempt 2 of 2" in job.error["message"] and "no attempts left" in job.error["message"]
    assert env.messages() == []


def test_live_jobs_are_left_alone(env: Env) -> None:
    running = env.new_job()
    env.claim(running, heartbeat_age=TIMEOUT - 10)  # late but within the timeout
    queued = env.new_job()  # its message is in the queue
    reaper = Reaper()
    now = time.time()
    for t in (now, now + 3, now + 6):  # past the reconcile grace, within the heartbeat timeout
        result = reaper.tick(now=t)
        assert (result.requeued, result.failed, result.resent) == ([], [], [])
    assert env.job(running).status == "running"
    assert env.messages().count(queued) == 1


def test_reconciler_resends_queued_jobs_the_broker_lost(env: Env) -> None:
    """A Redis restart/flush: queued jobs with no message are sent again once the grace period
    has passed, each once; a job whose message is still there is not."""
    lost = [env.new_job() for _ in range(3)]
    env.redis.delete(env.queue)  # what a restart of a Redis without persistence leaves
    kept = env.new_job()
    never_sent = env.new_job(send=False)  # the API could not reach Redis at all
    reaper = Reaper()
    now = time.time()
    assert reaper.tick(now=now).resent == []  # first seen missing: maybe a send still in flight
    assert reaper.tick(now=now + 4).resent == []
    assert reaper.tick(now=now + 5).resent == [*lost, never_sent]  # oldest first
    assert sorted(m or "" for m in env.messages()) == sorted([*lost, kept, never_sent])
    assert reaper.tick(now=now + 20).resent == []  # they are held now: not sent twice


def test_a_job_that_reappears_restarts_its_grace_period(env: Env) -> None:
    job_id = env.new_job()
    env.redis.delete(env.queue)
    reaper = Reaper()
    now = time.time()
    reaper.tick(now=now)
    assert enqueue_job(job_id)  # e.g. the API's own send reached Redis late
    assert reaper.tick(now=now + 3).resent == []
    env.redis.delete(env.queue)
    assert reaper.tick(now=now + 6).resent == []  # missing again since +6, not since +0
    assert reaper.tick(now=now + 11).resent == [job_id]


def test_one_api_process_ticks_at_a_time(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_REAPER_INTERVAL_SECONDS", "2")
    get_settings.cache_clear()
    first, second = Reaper(), Reaper()
    assert first.tick().skipped is False
    assert second.tick().skipped is True  # the other process holds this tick's lock
    assert first.tick().skipped is False
    time.sleep(1.9)  # the lock lives 0.9 intervals
    assert second.tick().skipped is False


def test_held_job_ids_reads_the_messages_enqueue_job_sends(env: Env) -> None:
    a, b = env.new_job(), env.new_job()
    # a job on several hosts' join message names its job but wakes no claim: it holds nothing
    c = env.new_job(send=False)
    enqueue_join(c, attempt=1, endpoint="10.0.0.1:29400", count=2)
    assert len(env.messages()) == 4
    assert held_job_ids(env.redis, {env.queue, "no-such-queue"}) == {a, b}
    assert message_job_id(b"not json") is None
    assert message_job_id(b'{"body": "W10="}') is None  # "[]": no args


def test_the_api_runs_the_loop(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's lifespan starts the loop (interval from settings) and stops it on shutdown."""
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_REAPER_INTERVAL_SECONDS", "0.2")
    get_settings.cache_clear()
    job_id = env.new_job()
    env.redis.delete(env.queue)
    env.claim(job_id, heartbeat_age=TIMEOUT + 1)
    with TestClient(create_app()):
        deadline = time.monotonic() + 10
        while env.job(job_id).status != "queued" and time.monotonic() < deadline:
            time.sleep(0.1)
    assert env.job(job_id).status == "queued"
    assert env.messages() == [job_id]


def test_a_frozen_worker_holding_its_job_row_is_ended_and_the_job_requeued(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker frozen inside a transaction (SIGSTOP between its heartbeat UPDATE and COMMIT)
    holds the job's row lock while frozen. The reaper must neither hang on that lock nor wait for
    the worker: it ends sessions of worker processes idle in a transaction past the heartbeat
    timeout. Another program's session holding the lock is never ended: that job waits, and the
    tick still returns."""
    import psycopg
    from sqlalchemy.engine import make_url

    from service.db.session import WORKER_APPLICATION, default_url
    from service.settings import get_settings

    url = default_url()
    if not url.startswith("postgresql"):
        pytest.skip("row locks held by another process: PostgreSQL")
    monkeypatch.setenv("LORAQ_HEARTBEAT_TIMEOUT_SECONDS", "1")
    get_settings.cache_clear()
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    job_id = env.new_job()
    env.redis.delete(env.queue)
    env.claim(job_id, heartbeat_age=5)

    def hold_row(application_name: str) -> psycopg.Connection:
        conn = psycopg.connect(dsn, application_name=application_name)
        conn.execute("UPDATE jobs SET heartbeat_at = heartbeat_at WHERE id = %s", (job_id,))
        return conn  # the transaction stays open: the row stays locked

    other = hold_row("some-admin-tool")
    time.sleep(1.2)
    started = time.monotonic()
    assert Reaper().tick().requeued == []  # the lock is not a worker's: the job waits
    assert time.monotonic() - started < 10
    assert env.job(job_id).status == "running"
    other.rollback()
    other.close()

    frozen = hold_row(WORKER_APPLICATION)
    time.sleep(1.2)
    assert Reaper().tick().requeued == [job_id]
    assert env.job(job_id).status == "queued"
    with pytest.raises(psycopg.OperationalError):  # its session was ended
        frozen.execute("SELECT 1")
    frozen.close()


def request_cancel(env: Env, job_id: str) -> None:
    """POST /v1/fine_tuning/jobs/{id}/cancel's service call: on a running job it only asks."""
    with session_scope() as s:
        assert jobs.request_cancel(s, tenant_id=env.tenant_id, job_id=job_id).cancel_requested


@pytest.mark.parametrize("attempts_left", [True, False])
def test_a_cancel_on_a_job_whose_worker_went_silent_ends_it_cancelled(env: Env, attempts_left: bool) -> None:
    """The worker went silent after the cancel was asked for: the reaper ends the job `cancelled`
    (not back to `queued`, where it needed a second cancel), sends no message, and fences the
    silent worker out."""
    job_id = env.new_job()
    env.redis.delete(env.queue)
    reaper = Reaper()
    if not attempts_left:  # attempt 2 of 2: without the cancel it would fail `worker_lost`
        env.claim(job_id, heartbeat_age=TIMEOUT + 1)
        assert reaper.tick().requeued == [job_id]
        env.redis.delete(env.queue)
    old = env.claim(job_id)
    request_cancel(env, job_id)
    assert env.job(job_id).status == "running"  # the worker is asked; it ends the job itself
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(heartbeat_at=time.time() - TIMEOUT - 1))
    result = reaper.tick()
    assert (result.cancelled, result.requeued, result.failed) == ([job_id], [], [])
    job = env.job(job_id)
    assert (job.status, job.attempt_token, job.error) == ("cancelled", None, None)
    assert job.finished_at is not None
    assert env.messages() == []
    with session_scope() as s:
        assert jobs.heartbeat(s, claim=old) is False
        events = list(s.scalars(select(JobEvent.message).where(JobEvent.job_id == job_id)))
    assert any(m.startswith("Fine-tuning job cancelled: its worker sent no heartbeat") for m in events)
    assert reaper.tick().cancelled == []


def test_a_cancel_requested_on_a_job_whose_worker_process_exited_ends_it_cancelled(env: Env) -> None:
    """`loraq up` saw the worker exit (release_jobs_of_worker, no heartbeat timeout to wait)."""
    import socket

    from service.reaper import release_jobs_of_worker

    job_id = env.new_job()
    env.redis.delete(env.queue)
    with session_scope() as s:
        claim = jobs.claim(s, job_id=job_id, worker_id=f"{socket.gethostname()}:cpu:4242")
    assert claim is not None
    request_cancel(env, job_id)
    result = release_jobs_of_worker(4242)
    assert (result.cancelled, result.requeued) == ([job_id], [])
    assert env.job(job_id).status == "cancelled"
    assert env.messages() == []


def test_a_queued_job_left_with_a_cancel_requested_is_cancelled(env: Env) -> None:
    """What an older release left: a job re-queued with its cancel request still set, which no
    worker claims. The next tick ends it."""
    job_id = env.new_job()
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    assert Reaper().tick().cancelled == [job_id]
    assert env.job(job_id).status == "cancelled"
