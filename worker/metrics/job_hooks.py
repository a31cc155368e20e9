"""What `worker.runner` and `worker.tasks` call as a job starts, steps and ends: the training
counters, the job's live gauges and its registry entry. The hooks never raise: a metrics or
registry failure must not fail a training run.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from service.step_metrics import StepData
from worker.engine.types import StepMetrics
from worker.metrics import registry
from worker.metrics.live_jobs import finish_live_job, write_live_job
from worker.metrics.training import training_metrics

log = logging.getLogger("loraq.worker.metrics")

JOB_KEY_REFRESH_SECONDS = 2.0


@dataclass
class _JobState:
    job_id: str
    model: str
    started: float
    max_grad_norm: float
    steps: int = 0
    clipped: int = 0
    valid_loss: float | None = None  # the last one seen: validation runs only every few steps
    job_key_written: float = float("-inf")


# Jobs started in this process and not finished yet, by id (one at a time with one job per GPU).
_active: dict[str, _JobState] = {}


def job_started(job_id: str, *, model: str, max_grad_norm: float) -> None:
    try:
        state = _JobState(job_id, model, time.monotonic(), max_grad_norm)
        _active[job_id] = state
        m = training_metrics()
        m.running_jobs.inc()
        m.compiled_kernels.set(1.0 if registry.kernels_status()["compiled"] else 0.0)
        _write_job_key(state, step=0, total=0)
    except Exception:
        log.warning("metrics: job_started failed", exc_info=True)


def observe_step(job_id: str, metrics: StepMetrics) -> None:
    s = _active.get(job_id)
    if s is None:
        return
    try:
        m = training_metrics()
        s.steps += 1
        clipped = s.max_grad_norm > 0 and metrics.grad_norm > s.max_grad_norm
        s.clipped += int(clipped)
        if metrics.valid_loss is not None:
            s.valid_loss = metrics.valid_loss
        write_live_job(
            {
                **StepData.from_metrics(metrics).model_dump(),
                "valid_loss": s.valid_loss,  # the gauge keeps the last validation loss between passes
                "job_id": job_id,
                "model": s.model,
                "clip_rate": s.clipped / s.steps,
            }
        )
        m.steps.inc()
        if clipped:
            m.clipped_steps.inc()
        m.tokens.inc(metrics.tokens)
        m.step_seconds.observe(metrics.step_seconds)
        if time.monotonic() - s.job_key_written >= JOB_KEY_REFRESH_SECONDS:
            _write_job_key(s, step=metrics.step, total=metrics.total_steps)
    except Exception:
        log.warning("metrics: observe_step failed", exc_info=True)


def active_job(default: str) -> str:
    """The job this process is training (one at a time), else `default`: a delivery of one job's
    message may claim another (fair share, `service.jobs.claim_next`)."""
    return next(iter(_active), default)


def job_finished(job_id: str, outcome: str) -> None:
    """Count the attempt's outcome; its duration when training had started in this process."""
    s = _active.pop(job_id, None)
    try:
        if s is not None:
            finish_live_job()
        m = training_metrics()
        m.jobs_finished.labels(outcome).inc()
        if s is not None:
            m.job_seconds.labels(outcome).observe(time.monotonic() - s.started)
            m.running_jobs.dec()
    except Exception:
        log.warning("metrics: job_finished failed", exc_info=True)
    if s is not None:
        registry.clear_job()


def _write_job_key(s: _JobState, *, step: int, total: int) -> None:
    s.job_key_written = time.monotonic()
    body = {"job_id": s.job_id, "model": s.model, "step": step, "total_steps": total, "pid": os.getpid()}
    registry.record_job(body)
