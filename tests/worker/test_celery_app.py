"""Delivery semantics of the Celery app come from settings and stay what the design needs."""

from __future__ import annotations

from service.settings import Settings
from worker.celery_app import RUN_JOB_TASK, celery_app, make_celery


def test_one_job_at_a_time_acked_late_and_redelivered_on_worker_loss() -> None:
    app = make_celery(Settings(redis_url="redis://example:6379/3", worker_queue="gpu-a100"))
    conf = app.conf
    assert conf.broker_url == "redis://example:6379/3"
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.worker_concurrency == 1
    assert conf.task_default_queue == "gpu-a100"
    assert conf.task_ignore_result is True


def test_visibility_timeout_outlives_the_longest_job() -> None:
    for wall in (60.0, 7 * 24 * 3600.0):
        conf = make_celery(Settings(job_max_wall_seconds=wall)).conf
        assert conf.broker_transport_options["visibility_timeout"] > wall


def test_run_job_task_is_registered_by_its_contract_name() -> None:
    import worker.tasks  # noqa: F401  (registers the task on the app)

    task = celery_app.tasks[RUN_JOB_TASK]
    assert task.name == "loraq.run_job"
    assert task.max_retries == 5
