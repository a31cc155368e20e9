"""Response models of the dashboard's JSON endpoints (`/dashboard/api`, `service.api.dashboard`).

Their field names are what the pages' scripts (`service/static/dashboard/*.js`) read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from service.step_metrics import StepRow
from service.worker_registry import GpuSample


class HealthWarningPublic(BaseModel):
    """A training-health warning the worker raised (a `warn` event's data)."""

    health: str  # its kind, e.g. "loss_spike"
    step: int | None


class JobProgressPublic(BaseModel):
    """A job with its latest step, as the Jobs page lists it."""

    id: str
    status: str
    model: str
    suffix: str | None
    error_code: str | None
    warnings: list[HealthWarningPublic]
    result_files: list[str]
    fine_tuned_model: str | None
    step: int
    total_steps: int | None
    train_loss: float | None
    tokens_per_s: float | None
    padding_fraction: float | None
    eta_seconds: float | None
    trained_tokens: int | None
    created_at: int
    started_at: int | None
    finished_at: int | None
    # one job's page only: what the run validates on, in the words of its event
    validation: str | None = None


class JobProgressListPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobProgressPublic]


class StepRowsPublic(BaseModel):
    """A job's stored steps, for the charts."""

    object: Literal["list"] = "list"
    data: list[StepRow]


class CheckpointSamplesPublic(BaseModel):
    step: int
    samples: list[str]  # greedy answers to the job's eval_prompts, in order


class SamplesPublic(BaseModel):
    object: Literal["list"] = "list"
    prompts: list[str]
    data: list[CheckpointSamplesPublic]


class BadLinePublic(BaseModel):
    line: int  # 1-based; 0 for a problem of the whole file
    reason: str


class FileSummaryPublic(BaseModel):
    """The structural check of an uploaded JSONL file (`service.api.dataset_summary`)."""

    file_id: str
    filename: str
    format: str | None
    examples: int
    messages: int
    assistant_messages: int
    tokens: int
    max_example_tokens: int
    bad_line_count: int
    bad_lines: list[BadLinePublic]
    token_count_method: str
    valid: bool


# A worker's registry entry (written by `worker.metrics.registry`). Every field but `node` may be missing
# from an entry (an older worker's), and the route returns only the fields an entry holds.
class KernelsPublic(BaseModel):
    compiled: bool
    reason: str | None = None


class WorkerJobPublic(BaseModel):
    """The job a worker runs; another tenant's job is shown as busy, without its id."""

    job_id: str | None
    model: str | None = None
    step: int | None = None
    total_steps: int | None = None
    pid: int | None = None
    other_tenant: bool | None = None


class WorkerPublic(BaseModel):
    node: str
    # "training": a Celery worker (`loraq worker`, its registry entry); "inference": a chat worker
    # (`loraq inference`, its heartbeat), which has a node, queue and last_seen only
    kind: Literal["training", "inference"] = "training"
    hostname: str | None = None
    pid: int | None = None
    queue: str | None = None
    metrics_port: int | None = None
    started_at: float | None = None
    last_seen: float | None = None
    kernels: KernelsPublic | None = None
    gpus: list[GpuSample] = []
    job: WorkerJobPublic | None = None


class WorkersPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[WorkerPublic]
