"""Celery tasks. Thin on purpose: a task takes an id and calls one function.

`job_task` owns what every task needs (logging with timing, retries on infrastructure errors),
so task bodies stay one line. Job-level failures (bad dataset, engine errors, crashes inside the
training run) never escape `run_claimed_job`: they end the job `failed` in the database. Only
errors reaching the database or the broker escape, and those are retried with backoff; the fenced
claim makes a retry of an already-running job a no-op.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.exceptions
import sqlalchemy.exc

from service.broker import JOIN_JOB_TASK
from worker import metrics as worker_metrics
from worker.celery_app import RUN_JOB_TASK, celery_app

log = logging.getLogger("loraq.worker")

RETRYABLE = (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError, redis.exceptions.ConnectionError)


def job_task(name: str) -> Callable[[Callable[..., str]], Any]:
    """Register `fn(job_id, *args) -> outcome` as Celery task `name` with logging and retries."""

    def decorate(fn: Callable[..., str]) -> Any:
        @celery_app.task(
            name=name,
            bind=True,
            autoretry_for=RETRYABLE,
            retry_backoff=2,
            retry_backoff_max=60,
            max_retries=5,
        )
        @functools.wraps(fn)
        def task(self: Any, job_id: str, *args: Any) -> str:
            start = time.monotonic()
            log.info("task %s[%s] job=%s start", name, self.request.id, job_id)
            try:
                outcome = fn(job_id, *args)
            except RETRYABLE:
                log.warning("task %s job=%s: infrastructure error, will retry", name, job_id, exc_info=True)
                worker_metrics.job_finished(worker_metrics.active_job(job_id), "retry")
                raise
            worker_metrics.job_finished(worker_metrics.active_job(job_id), outcome)  # never raises
            log.info("task %s job=%s done: %s in %.2fs", name, job_id, outcome, time.monotonic() - start)
            return outcome

        return task

    return decorate


@job_task(RUN_JOB_TASK)
def run_job(job_id: str) -> str:
    from worker.runner import run_claimed_job  # keeps `import worker.tasks` free of torch

    return run_claimed_job(job_id)


@job_task(JOIN_JOB_TASK)
def join_job(job_id: str, attempt: int, endpoint: str) -> str:
    from worker.runner import join_claimed_job

    return join_claimed_job(job_id, attempt=attempt, endpoint=endpoint)
