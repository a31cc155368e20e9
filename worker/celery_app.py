"""The Celery application: one object, configured from `Settings`.

Delivery semantics (why each option):
- `task_acks_late` + `task_reject_on_worker_lost`: a job message is acknowledged only after the
  task returns, so a worker killed mid-job leaves the message to be redelivered. The database
  (fenced claim in `service.jobs`) decides whether a redelivery may run; Redis does not.
- `worker_prefetch_multiplier=1` and concurrency 1: one job per GPU, and an idle worker never
  holds a second job's message that another worker could run.
- `visibility_timeout` longer than any job may run: Redis re-delivers an unacked message after
  this many seconds, which must never happen to a job that is still training.
- No result backend: job state lives in the database, never in Celery results.

The task name `loraq.run_job` with `args=[job_id]` is the contract with `service.queue`.
"""

from __future__ import annotations

import logging

from celery import Celery
from celery.signals import (
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from service.settings import Settings, get_settings

RUN_JOB_TASK = "loraq.run_job"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# Redis visibility timeout = longest job wall time + this margin (seconds).
VISIBILITY_MARGIN_SECONDS = 3600

log = logging.getLogger("loraq.worker")


def broker_url(settings: Settings) -> str:
    return settings.redis_url or DEFAULT_REDIS_URL


def make_celery(settings: Settings) -> Celery:
    app = Celery("loraq", broker=broker_url(settings), include=["worker.tasks"])
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
        broker_transport_options={
            "visibility_timeout": int(settings.job_max_wall_seconds) + VISIBILITY_MARGIN_SECONDS
        },
        # A job's status is in the database; Celery's own events would only add Redis traffic.
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
    )
    return app


celery_app = make_celery(get_settings())


@worker_ready.connect
def _log_worker_start(**_: object) -> None:
    # Imported here: the API process imports this module to send tasks and must never load torch.
    from worker.runner import on_worker_start

    on_worker_start()


@worker_shutting_down.connect
def _stop_running_job(**_: object) -> None:
    # A warm shutdown waits for the running task: make that task stop at its next step instead.
    from worker.runner import on_worker_shutting_down

    on_worker_shutting_down()


# Worker metrics (issue 5, worker/metrics.py): /metrics server and worker registry in the main
# process before the pool forks; registry entry removed at shutdown; a pool child's live gauges
# dropped when it exits. worker.metrics imports no torch at module level.
@worker_init.connect
def _start_worker_metrics(**_: object) -> None:
    from worker.metrics import on_worker_init

    on_worker_init()


@worker_shutdown.connect
def _stop_worker_metrics(**_: object) -> None:
    from worker.metrics import on_worker_shutdown

    on_worker_shutdown()


@worker_process_shutdown.connect
def _pool_process_exit(pid: int, **_: object) -> None:
    from worker.metrics import on_pool_process_exit

    on_pool_process_exit(pid)
