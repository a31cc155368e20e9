"""The job queue's broker settings and names, shared by whoever sends and whoever consumes.

The control plane sends `loraq.run_job(job_id)` by name (service/queue.py) and the worker
consumes it (worker/celery_app.py, worker/tasks.py); both build their Celery app with
`make_celery`, so delivery semantics live in one place and the service never imports the worker.

Delivery semantics (why each option):
- `task_acks_late` + `task_reject_on_worker_lost`: a job message is acknowledged only after the
  task returns, so a worker killed mid-job leaves the message to be redelivered. The database
  (fenced claim in `service.jobs`) decides whether a redelivery may run; Redis does not.
- `worker_prefetch_multiplier=1` and concurrency 1: one job per GPU, and an idle worker never
  holds a second job's message that another worker could run.
- `visibility_timeout` longer than any job may run: Redis re-delivers an unacked message after
  this many seconds, which must never happen to a job that is still training.
- No result backend: job state lives in the database, never in Celery results.

No torch here, nor anything of `worker/`: the task module is named as a string (`include`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

RUN_JOB_TASK = "loraq.run_job"
TASK_MODULES = ["worker.tasks"]
# Redis visibility timeout = longest job wall time + this margin (seconds).
VISIBILITY_MARGIN_SECONDS = 3600


class RoutingError(ValueError):
    """Bad `--gpus`/`--gpus-per-job`/queue input; the message names the option."""


def celery_queue(worker_class: str, n_gpus: int = 1) -> str:
    """The Celery queue for a job of this worker class and GPU count.

    `("h100", 1)` -> `"h100"`; `("h100", 2)` -> `"h100-x2"`. A multi-GPU job gets its own queue so
    that a one-GPU worker never takes it: only children started with `--gpus-per-job n` consume
    `<class>-x<n>`.
    """
    if not worker_class or not all(c.isalnum() or c in "-_" for c in worker_class):
        raise RoutingError(f"queue: {worker_class!r} must be letters, digits, '-' or '_'")
    if n_gpus < 1:
        raise RoutingError(f"n_gpus must be >= 1, got {n_gpus}")
    return worker_class if n_gpus == 1 else f"{worker_class}-x{n_gpus}"


def make_celery(settings: Settings) -> Celery:
    from celery import Celery

    app = Celery("loraq", broker=settings.resolved_redis_url, include=TASK_MODULES)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_ignore_result=True,
        task_default_queue=settings.worker_queue,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        # Bounded broker calls: every socket operation and connect has a timeout, and a
        # publish retries at most `broker_publish_retries` times (service.queue adds a deadline).
        broker_connection_timeout=settings.redis_connect_timeout_seconds,
        broker_transport_options={
            "visibility_timeout": int(settings.job_max_wall_seconds) + VISIBILITY_MARGIN_SECONDS,
            "socket_timeout": settings.redis_socket_timeout_seconds,
            "socket_connect_timeout": settings.redis_connect_timeout_seconds,
            "max_retries": settings.broker_publish_retries,
        },
        # A job's status is in the database; Celery's own events would only add Redis traffic.
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app
