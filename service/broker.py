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

Redis outages (a stall, a restart, an append-only file replaying) are ridden out, never fatal:
- the worker reconnects forever (`broker_connection_max_retries=None`), with Celery's backoff;
- an acknowledgement that meets a stalled Redis is retried until Redis answers
  (service/broker_transport.py), since a lost one would stop the consumer for good;
- a running job keeps training through an outage (it needs the database, not Redis:
  `worker_cancel_long_running_tasks_on_connection_loss=False`) and is acknowledged afterwards;
- should the consumer stop taking messages anyway, the worker notices and restarts itself
  (worker/consumer_watch.py).

No torch here, nor anything of `worker/`: the task module is named as a string (`include`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.settings import Settings

if TYPE_CHECKING:
    from celery import Celery

RUN_JOB_TASK = "loraq.run_job"
# `loraq.join_job(job_id, attempt, endpoint)`: one more worker for an attempt of a job on several
# hosts, sent by the worker that claimed it to the job's own queue (service/queue.py: enqueue_join)
JOIN_JOB_TASK = "loraq.join_job"
# Kombu's Redis transport keeps one list per priority step: "<queue>" for priority 0 and
# "<queue>\x06\x16<p>" for the others (default steps 0, 3, 6, 9); "unacked" holds delivered,
# not yet acknowledged messages of every queue.
KOMBU_PRIORITY_SEP = "\x06\x16"
KOMBU_PRIORITY_STEPS = (0, 3, 6, 9)
KOMBU_UNACKED_KEY = "unacked"
TASK_MODULES = ["worker.tasks"]
BROKER_TRANSPORT = "service.broker_transport:Transport"  # Kombu's Redis transport, acks retried
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


def kombu_queue_depth(client: Any, queue: str) -> int:
    """Messages waiting in `queue` across Kombu's priority lists."""
    keys = [queue if p == 0 else f"{queue}{KOMBU_PRIORITY_SEP}{p}" for p in KOMBU_PRIORITY_STEPS]
    pipe = client.pipeline()
    for key in keys:
        pipe.llen(key)
    return int(sum(pipe.execute()))


def make_celery(settings: Settings) -> Celery:
    from celery import Celery

    app = Celery("loraq", broker=settings.resolved_redis_url, include=TASK_MODULES)
    app.conf.update(
        broker_transport=BROKER_TRANSPORT,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=1,
        task_ignore_result=True,
        task_default_queue=settings.worker_queue,
        task_serializer="json",
        accept_content=["json"],
        broker_connection_retry_on_startup=True,
        broker_connection_retry=True,
        broker_connection_max_retries=None,  # an outage of any length is waited out
        worker_cancel_long_running_tasks_on_connection_loss=False,
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
