"""The worker's Celery application: `make_celery` from settings (service/broker.py holds the
broker settings, the delivery semantics and the task name, shared with the sender), plus the
worker's lifecycle signals.

The task names `loraq.run_job` with `args=[job_id]` and `loraq.join_job` with
`args=[job_id, attempt, endpoint]` (a job on several hosts) are the contract with `service.queue`.
"""

from __future__ import annotations

import logging
import warnings

from celery.exceptions import CPendingDeprecationWarning
from celery.signals import (
    task_received,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)

from service.broker import RUN_JOB_TASK, make_celery
from service.settings import get_settings
from worker import consumer_watch

__all__ = ["RUN_JOB_TASK", "celery_app", "make_celery"]

log = logging.getLogger("loraq.worker")


celery_app = make_celery(get_settings())

# Celery warns on every broker reconnect that a future version will cancel running late-ack tasks on
# connection loss; service/broker.py decided (worker_cancel_long_running_tasks_on_connection_loss
# False: a job trains on through a Redis outage), so the warning would only alarm an operator.
warnings.filterwarnings(
    "ignore",
    message=r"\s*In Celery 5.1 we introduced an optional breaking change",  # CANCEL_TASKS_BY_DEFAULT
    category=CPendingDeprecationWarning,
)


@worker_ready.connect
def _log_worker_start(**_: object) -> None:
    # Imported here: loading the Celery app (the CLI, tests) must not load torch.
    from worker.runner import on_worker_start

    on_worker_start()


# The consumer watch (worker/consumer_watch.py): a worker whose consumer stops taking messages
# restarts itself. It starts once the consumer is up, and follows the messages it receives.
@worker_ready.connect
def _watch_consumer(**_: object) -> None:
    consumer_watch.start()


@task_received.connect
def _message_received(**_: object) -> None:
    if (watch := consumer_watch.current()) is not None:
        watch.received()


@worker_shutting_down.connect
def _stop_running_job(**_: object) -> None:
    # A warm shutdown waits for the running task: make that task stop at its next step instead.
    from worker.runner import on_worker_shutting_down

    on_worker_shutting_down()


@worker_init.connect
def _name_database_sessions(**_: object) -> None:
    # A worker frozen mid-transaction is found (and its row locks freed) by this name: reaper.py.
    from service.db.session import WORKER_APPLICATION, set_application_name

    set_application_name(WORKER_APPLICATION)


@worker_init.connect
def _configure_kernels(**_: object) -> None:
    # Before the metrics below: their registry entry says which kernel path runs.
    from worker.kernels import configure_kernels

    configure_kernels()


# Worker metrics (worker/metrics/): /metrics server and worker registry in the main
# process before the pool forks; registry entry removed at shutdown; a pool child's live gauges
# dropped when it exits. worker.metrics imports no torch at module level.
@worker_init.connect
def _start_worker_metrics(**_: object) -> None:
    from worker.metrics import on_worker_init

    on_worker_init()


@worker_shutdown.connect
def _stop_worker_metrics(**_: object) -> None:
    from worker.metrics import on_worker_shutdown

    consumer_watch.stop()
    on_worker_shutdown()


@worker_process_shutdown.connect
def _pool_process_exit(pid: int, **_: object) -> None:
    from worker.metrics import on_pool_process_exit

    on_pool_process_exit(pid)
