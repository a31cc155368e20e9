"""A fine-tuning job's statuses, OpenAI's names, declared once (the API's schemas, the dashboard's
filter, the state machine and the Prometheus gauge all use these):

    validating_files ─► queued ─► running ─► succeeded | failed | cancelled
                          ▲          │
                          └─ paused ◄┘  (pause: a checkpoint, the GPU freed; resume: queued again)
"""

from __future__ import annotations

from typing import Literal, get_args

# A Literal rather than an Enum: the OpenAPI schema stays an inline string enum, as OpenAI's is.
JobStatus = Literal["validating_files", "queued", "running", "paused", "succeeded", "failed", "cancelled"]
JOB_STATUSES: tuple[JobStatus, ...] = get_args(JobStatus)
ACTIVE: tuple[JobStatus, ...] = ("validating_files", "queued", "running")
# Neither active (it holds no GPU, no queue slot) nor terminal (a resume queues it again)
PAUSED: JobStatus = "paused"
UNFINISHED: tuple[JobStatus, ...] = (*ACTIVE, PAUSED)  # a job that may still read its files
TERMINAL: tuple[JobStatus, ...] = ("succeeded", "failed", "cancelled")
