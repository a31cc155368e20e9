"""Worker metrics for Prometheus, and the worker registry the dashboard's Workers page reads.

Process model: the worker's main process serves `/metrics` (`server`). `loraq worker` runs jobs in
that same process (solo pool); with a prefork pool they run in a child. Either way the training
counters and histograms go through prometheus_client's multiprocess mode (`training`); per-job
gauges (labelled `job_id`) go through small live-job files instead (`live_jobs`), so that they
disappear after the job. GPU series are read from NVML at scrape time (`gpus`); on a host without
NVML they are absent. The registry entries in Redis are written by `registry`.

The names below are what the rest of the worker calls (`worker.runner`, `worker.tasks`,
`worker.celery_app`).
"""

from worker.metrics.job_hooks import active_job, job_finished, job_started, observe_step
from worker.metrics.server import on_pool_process_exit, on_worker_init, on_worker_shutdown

__all__ = [
    "active_job",
    "job_finished",
    "job_started",
    "observe_step",
    "on_pool_process_exit",
    "on_worker_init",
    "on_worker_shutdown",
]
