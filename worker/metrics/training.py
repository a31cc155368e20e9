"""The training counters and histograms, in prometheus_client's multiprocess mode.

Every process writes its values to mmap files under `PROMETHEUS_MULTIPROC_DIR` and the serving
process's `MultiProcessCollector` merges them at scrape time (`worker.metrics.server`).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_SECONDS_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 48 * 3600)


def prepare_multiprocess_dir(path: Path) -> None:
    """Point prometheus_client at a fresh multiprocess directory, before any metric exists.

    prometheus_client picks its value class when it is first imported; if something imported it
    before this ran, rebind the class so that the metrics created later write to mmap files.
    """
    shutil.rmtree(path, ignore_errors=True)  # stale files from a previous run would be merged in
    path.mkdir(parents=True, exist_ok=True)
    # prometheus_client's own variable (not a setting): it and the pool children read it from here
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    from prometheus_client import values

    from worker.metrics.allocated_mmap import install

    install()  # a full disk is an OSError from a metric call, not SIGBUS
    values.ValueClass = values.get_value_class()


class TrainingMetrics:
    """The training series. Created lazily per process (after `prepare_multiprocess_dir`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.compiled_kernels = Gauge(
            "loraq_gpu_kernels_compiled",
            "1 when the compiled CUDA LoRA kernels are in use, 0 on the reference path",
            multiprocess_mode="livemax",
        )
        self.running_jobs = Gauge("loraq_worker_running_jobs", "Jobs running", multiprocess_mode="livesum")
        self.steps = Counter("loraq_train_steps", "Optimizer steps taken")
        self.clipped_steps = Counter("loraq_train_clipped_steps", "Steps whose gradient norm was clipped")
        self.tokens = Counter("loraq_train_tokens", "Tokens trained on")
        self.step_seconds = Histogram(
            "loraq_train_step_seconds", "Wall time of one optimizer step", buckets=STEP_SECONDS_BUCKETS
        )
        self.job_seconds = Histogram(
            "loraq_job_duration_seconds",
            "Wall time of one job attempt on this worker, by outcome",
            ["outcome"],
            buckets=JOB_SECONDS_BUCKETS,
        )
        self.jobs_finished = Counter("loraq_jobs_finished", "Job attempts finished, by outcome", ["outcome"])


_training: TrainingMetrics | None = None
_training_lock = threading.Lock()


def training_metrics() -> TrainingMetrics:
    global _training
    with _training_lock:
        if _training is None:
            _training = TrainingMetrics()
        return _training
