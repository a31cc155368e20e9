"""Wake-ups for workers: send Celery task `loraq.run_job(job_id)` by name.

The database is the source of truth: a job is `queued` in the database before its message is
sent, and a failed send leaves it `queued` for the reconciler to re-send, so a broker outage
never loses a job (and never fails the API request that created it). The `queued` row is the
transactional outbox: it is written in the same transaction as the job, and the reconciler relays it.

Bounded: a publish runs on a small thread pool and the caller waits at most
`broker_publish_timeout_seconds` for it (Kombu's own timeouts bound each socket call, but its
connection pool can make a caller queue behind other stuck publishes). After a miss, publishes are
skipped for `broker_backoff_seconds`, so a frozen Redis costs one wait, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from service.broker import JOIN_JOB_TASK, RUN_JOB_TASK
from service.settings import Settings, get_settings

if TYPE_CHECKING:
    from celery import Celery

    from service.db.models import Job

log = logging.getLogger("loraq.api")

PUBLISH_THREADS = 4


def retry_policy(settings: Settings) -> dict[str, float]:
    """Kombu's publish retries: `broker_publish_retries` quick tries, then give up (the reconciler
    re-sends later)."""
    return {
        "max_retries": settings.broker_publish_retries,
        "interval_start": 0.0,
        "interval_step": 0.2,
        "interval_max": 0.5,
    }


class _Publisher:
    """A deadline on each publish, and a pause on publishing after one missed it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(PUBLISH_THREADS, thread_name_prefix="loraq-publish")
        self._lock = threading.Lock()
        self._paused_until = 0.0

    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

    def pause(self, seconds: float) -> None:
        with self._lock:
            self._paused_until = max(self._paused_until, time.monotonic() + seconds)

    def send(self, settings: Settings, task: str, args: list[Any], queue: str) -> None:
        app = celery_for(settings)
        future = self._pool.submit(
            app.send_task,
            task,
            args=args,
            queue=queue,
            retry=True,
            retry_policy=retry_policy(settings),
        )
        try:
            future.result(timeout=settings.broker_publish_timeout_seconds)
        except FutureTimeout as e:
            future.cancel()  # not started yet: it never sends (the reconciler will)
            raise TimeoutError(
                f"publish missed its {settings.broker_publish_timeout_seconds:g}s deadline"
            ) from e


_publisher = _Publisher()


def broker_paused() -> bool:
    """True while publishes are skipped after a failed one (the broker looked unreachable)."""
    return _publisher.paused()


@lru_cache(maxsize=4)
def _celery_for(broker: str, queue: str) -> Celery:
    from service.broker import make_celery

    settings = get_settings().model_copy(update={"redis_url": broker, "worker_queue": queue})
    return make_celery(settings)


def celery_for(settings: Settings) -> Celery:
    return _celery_for(settings.resolved_redis_url, settings.worker_queue)


def job_queue(job: Job) -> str:
    """The Celery queue of a job: its worker class, `-x<n>` for multi-GPU jobs."""
    from service.broker import celery_queue

    return celery_queue(job.queue, job.n_gpus)


def _stored_queue(job_id: str) -> str | None:
    from service.db.models import Job
    from service.db.session import session_scope

    with session_scope() as session:
        job = session.scalar(select(Job).where(Job.id == job_id))
        return job_queue(job) if job is not None else None


def enqueue_job(job_id: str, *, queue: str | None = None) -> bool:
    """Send the job's wake-up; False (logged) when the broker cannot be reached.

    `queue` None (re-queues, the reconciler): the job's stored routing is read from the database,
    so a re-sent job goes back to its own worker class.
    """
    settings = get_settings()
    if _publisher.paused():
        log.info("broker paused after a failed publish; job %s stays queued for the reconciler", job_id)
        return False
    try:
        target = queue or _stored_queue(job_id) or settings.worker_queue
        _publisher.send(settings, RUN_JOB_TASK, [job_id], target)
    except Exception:
        _publisher.pause(settings.broker_backoff_seconds)
        log.warning("could not enqueue job %s; it stays queued for the reconciler", job_id, exc_info=True)
        return False
    return True


def enqueue_join(job_id: str, *, attempt: int, endpoint: str, count: int) -> None:
    """Ask `count` more workers of the job's queue to join attempt `attempt` of a job on several
    hosts, at the rendezvous `endpoint` (host:port). Raises when the broker cannot be reached: the
    caller (the worker that claimed the job) ends the attempt, and the job goes back to the queue."""
    settings = get_settings()
    target = _stored_queue(job_id) or settings.worker_queue
    for _ in range(count):
        _publisher.send(settings, JOIN_JOB_TASK, [job_id, attempt, endpoint], target)
