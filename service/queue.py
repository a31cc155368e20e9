"""Wake-ups for workers: send Celery task `loraq.run_job(job_id)` by name.

The database is the source of truth: a job is `queued` in the database before its message is
sent, and a failed send leaves it `queued` for the reconciler to re-send, so a broker outage
never loses a job (and never fails the API request that created it).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import TYPE_CHECKING

from sqlalchemy import select

from service.settings import Settings, get_settings

if TYPE_CHECKING:
    from celery import Celery

    from service.db.models import Job

log = logging.getLogger("loraq.api")

# Publishing retries: a few quick tries, then give up (the reconciler re-sends later).
RETRY_POLICY = {"max_retries": 2, "interval_start": 0.0, "interval_step": 0.2, "interval_max": 0.5}


@lru_cache(maxsize=4)
def _celery_for(broker: str, queue: str) -> Celery:
    from service.broker import make_celery

    settings = get_settings().model_copy(update={"redis_url": broker, "worker_queue": queue})
    return make_celery(settings)


def celery_for(settings: Settings) -> Celery:
    from service.broker import broker_url

    return _celery_for(broker_url(settings), settings.worker_queue)


def job_queue(job: Job) -> str:
    """The Celery queue of a job (issue 7): its worker class, `-x<n>` for multi-GPU jobs."""
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
    from service.broker import RUN_JOB_TASK

    settings = get_settings()
    try:
        target = queue or _stored_queue(job_id) or settings.worker_queue
        celery_for(settings).send_task(
            RUN_JOB_TASK, args=[job_id], queue=target, retry=True, retry_policy=RETRY_POLICY
        )
    except Exception:
        log.warning("could not enqueue job %s; it stays queued for the reconciler", job_id, exc_info=True)
        return False
    return True
