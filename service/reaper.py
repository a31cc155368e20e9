"""The reaper and the reconciler: one periodic loop in the API process.

Each tick (every `reaper_interval_seconds`):

1. Reaper. A `running` job whose heartbeat is older than `heartbeat_timeout_seconds` lost its
   worker (killed, frozen, cut off). If a cancel was requested, it ends `cancelled`
   (`jobs.cancel_stale`): the worker that would have stopped it is gone. Otherwise, while it has
   attempts left (`attempt < max_attempts`) it goes back to `queued` (`jobs.requeue`, which
   clears the attempt token so the silent worker's later writes are refused) and is sent again;
   the next worker resumes it from its last checkpoint. Else it ends `failed` with code
   `worker_lost` and the reason (`jobs.fail_stale`). A `queued` job with a cancel requested
   (which no worker claims) ends `cancelled`.
2. Reconciler. The database is the source of truth and Redis only carries wake-ups, so a Redis
   restart or flush, or a send that failed, can leave a `queued` job with no message. A `queued`
   job absent from its queue's Redis list on ticks at least `reconcile_grace_seconds` apart is
   sent again. Messages a worker already took (Kombu's `unacked` hash) are deliberately not
   counted: a worker that died holding one never acks it, and a live worker claims the job
   within milliseconds of taking it, long before the grace period ends.

3. Files. A job whose files' token counts were being computed in the background
   (`validating_files`) is settled once they exist, and counted again where no process counts
   them (an API restart, a killed counter): service/file_validation.py, `tick`.

Re-sending is always safe: `jobs.claim` is a fenced `queued → running` UPDATE, so a duplicate
message finds the job running (or done) and is skipped. With several API processes
(`LORAQ_API_WORKERS`) a short Redis lock lets one of them do each tick; if Redis cannot be
reached the tick still reaps (pure database work) and re-sends are left to a later tick.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from service import file_validation, jobs
from service.broker import RUN_JOB_TASK
from service.db.session import WORKER_APPLICATION, end_idle_transactions, session_scope, set_lock_timeout
from service.periodic import PeriodicThread
from service.queue import enqueue_job
from service.settings import get_settings

log = logging.getLogger("loraq.reaper")

LOCK_KEY = "loraq:reaper:lock:{}"  # + a digest of the database URL: one lock per deployment


@dataclass
class TickResult:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # a cancel was requested: ended, not re-queued
    resent: list[str] = field(default_factory=list)
    validated: list[str] = field(default_factory=list)  # left validating_files (service/file_validation.py)
    skipped: bool = False  # another API process holds this tick's lock


def _redis_client() -> Any:
    from service.redis_client import redis_client

    return redis_client(get_settings())


def message_job_id(raw: bytes | str) -> str | None:
    """The job id of a `loraq.run_job` message as Kombu's Redis transport stores it (JSON with a
    base64 body holding Celery's `[args, kwargs, embed]`), or None for anything else: a
    `loraq.join_job` message (a job on several hosts) names its job too, but wakes no claim."""
    try:
        message = json.loads(raw)
        if message.get("headers", {}).get("task", RUN_JOB_TASK) != RUN_JOB_TASK:
            return None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return str(args[0]) if args else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def held_job_ids(client: Any, queues: set[str]) -> set[str]:
    """Job ids with a message waiting in one of `queues` (Kombu keeps each queue as a Redis list)."""
    held: set[str] = set()
    for queue in queues:
        for raw in client.lrange(queue, 0, -1):
            job_id = message_job_id(raw)
            if job_id is not None:
                held.add(job_id)
    return held


ROW_LOCK_TIMEOUT_S = 2.0  # how long releasing a job waits for its row


class Reaper:
    """One tick at a time; keeps, between ticks, when each queued job was first seen missing."""

    def __init__(self) -> None:
        self._missing_since: dict[str, float] = {}
        self._lock_token = f"{os.getpid()}-{id(self)}"

    def tick(self, now: float | None = None) -> TickResult:
        settings = get_settings()
        now = time.time() if now is None else now
        result = TickResult()
        client = _redis_client()
        try:
            if not self._take_lock(client, settings.reaper_interval_seconds):
                result.skipped = True
                return result
            self._reap(now, result)
            result.validated = file_validation.tick(now)
            self._reconcile(client, now, result)
        finally:
            client.close()
        if result.requeued or result.failed or result.cancelled or result.resent:
            log.warning(
                "reaper: re-queued %s, failed %s, cancelled %s, re-sent %s",
                result.requeued,
                result.failed,
                result.cancelled,
                result.resent,
            )
        return result

    def _take_lock(self, client: Any, interval: float) -> bool:
        import redis

        from service.db.session import default_url

        key = LOCK_KEY.format(hashlib.sha256(default_url().encode()).hexdigest()[:16])
        ttl_ms = max(100, int(interval * 900))  # expires before the next tick of any process
        try:
            return bool(client.set(key, self._lock_token, nx=True, px=ttl_ms)) or (
                client.get(key) == self._lock_token.encode()
            )
        except redis.exceptions.RedisError:
            return True  # no Redis, no lock: reaping is fenced database work, safe to repeat

    def _reap(self, now: float, result: TickResult) -> None:
        settings = get_settings()
        timeout, max_attempts = settings.heartbeat_timeout_seconds, settings.max_attempts
        ended: list[int] = []
        with session_scope() as session:
            stale = jobs.stale_running_jobs(session, older_than=now - timeout)
            if stale:  # a worker frozen mid-transaction holds its job's row lock: end its session
                ended = end_idle_transactions(
                    session, application_name=WORKER_APPLICATION, idle_seconds=timeout
                )
        if ended:
            log.warning(
                "reaper: ended worker database sessions %s, idle in a transaction for over %gs",
                ended,
                timeout,
            )
        for job_id, token, attempt in stale:
            silent = f"its worker sent no heartbeat for {timeout:g}s (attempt {attempt} of {max_attempts})"
            if release_attempt(job_id, token, attempt, silent, result):
                self._missing_since.pop(job_id, None)
        with session_scope() as session:
            result.cancelled += jobs.cancel_requested_queued(session)

    def _reconcile(self, client: Any, now: float, result: TickResult) -> None:
        import redis

        from service.broker import celery_queue

        with session_scope() as session:
            queued = jobs.queued_jobs(session)
        routes = {job_id: celery_queue(q, n) for job_id, q, n in queued}
        try:
            held = held_job_ids(client, set(routes.values()))
        except redis.exceptions.RedisError:
            log.info("reconciler: Redis unreachable; queued jobs are re-sent once it is back")
            return
        missing = {job_id for job_id in routes if job_id not in held and job_id not in result.requeued}
        self._missing_since = {j: t for j, t in self._missing_since.items() if j in missing}
        grace = get_settings().reconcile_grace_seconds
        for job_id in (j for j in routes if j in missing):  # oldest first
            since = self._missing_since.setdefault(job_id, now)
            if now - since >= grace and enqueue_job(job_id, queue=routes[job_id]):
                result.resent.append(job_id)
                del self._missing_since[job_id]


def release_attempt(job_id: str, token: str, attempt: int, why: str, result: TickResult) -> bool:
    """A running attempt whose worker is gone: back to `queued` and re-sent while attempts are
    left (True once sent), else `failed` with code `worker_lost`. Both are fenced on the token."""
    from sqlalchemy.exc import OperationalError

    max_attempts = get_settings().max_attempts
    try:
        with session_scope() as session:
            # a row lock held elsewhere costs this job one tick, never the reaper's thread
            set_lock_timeout(session, ROW_LOCK_TIMEOUT_S)
            if jobs.cancel_stale(session, job_id=job_id, attempt_token=token, reason=why):
                result.cancelled.append(job_id)  # cancel means cancel: not back to the queue
                return False
            if attempt >= max_attempts:
                reason = f"Job failed: {why}; no attempts left"
                if jobs.fail_stale(session, job_id=job_id, attempt_token=token, reason=reason):
                    result.failed.append(job_id)
                return False
            requeued = jobs.requeue(
                session,
                job_id=job_id,
                attempt_token=token,
                reason=f"{why}; the next attempt resumes from its last checkpoint, if it saved one",
            )
    except OperationalError as e:
        log.warning("reaper: job %s not released this tick (%s)", job_id, str(e).splitlines()[0])
        return False
    if not requeued:
        return False
    result.requeued.append(job_id)  # committed: a worker that takes the message finds it queued
    return enqueue_job(job_id)


def release_jobs_of_worker(worker_pid: int) -> TickResult:
    """Release the attempts held by worker process `worker_pid` of this host, which is known dead
    (`loraq up` saw it exit): the job resumes now, not after the heartbeat timeout."""
    import socket

    max_attempts = get_settings().max_attempts
    result = TickResult()
    with session_scope() as session:
        held = jobs.running_jobs_of_worker(session, host=socket.gethostname(), pid=worker_pid)
    for job_id, token, attempt in held:
        why = f"its worker (pid {worker_pid}) died (attempt {attempt} of {max_attempts})"
        release_attempt(job_id, token, attempt, why, result)
    return result


class ReaperThread(PeriodicThread):
    """Runs `Reaper.tick` every `interval` seconds in a daemon thread until `stop()`."""

    def __init__(self, interval: float) -> None:
        self.reaper = Reaper()
        super().__init__("reaper", interval, self.reaper.tick)
