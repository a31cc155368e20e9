"""Per-job gauges (loss, grad norm, ...): they exist while the job runs and for
`LIVE_JOB_GRACE_SECONDS` after.

prometheus_client cannot remove a labelled series in multiprocess mode (they would be exported
forever), so these do not go through its mmap files: the process running a job writes them to
`live-job-<pid>.json` in the multiprocess directory after every step (atomic rename) and marks the
file finished at the end; `LiveJobCollector` in the serving process turns the files into gauges at
scrape time and deletes those finished more than the grace period ago. A file's values are a step's
`service.step_metrics.StepData` plus the job's id, model and clip rate.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LIVE_JOB_GAUGES = (  # (metric, help, state key, labels)
    ("loraq_train_loss", "Training loss of the last step", "train_loss", ("job_id", "model")),
    ("loraq_train_valid_loss", "Last validation loss", "valid_loss", ("job_id", "model")),
    ("loraq_train_grad_norm", "Gradient norm of the last step, before clipping", "grad_norm", ("job_id",)),
    ("loraq_train_learning_rate", "Learning rate of the last step", "lr", ("job_id",)),
    ("loraq_train_tokens_per_second", "Training throughput", "tokens_per_s", ("job_id",)),
    ("loraq_train_step", "Optimizer step reached", "step", ("job_id",)),
    ("loraq_train_total_steps", "Optimizer steps planned", "total_steps", ("job_id",)),
    (
        "loraq_train_clip_rate",
        "Fraction of the job's steps whose gradient norm exceeded max_grad_norm",
        "clip_rate",
        ("job_id",),
    ),
)
LIVE_JOB_GLOB = "live-job-*.json"
LIVE_JOB_GRACE_SECONDS = 60.0


def live_job_path(pid: int | None = None) -> Path | None:
    """This process's live-job file, or None when no metrics server set a multiprocess dir."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return None
    return Path(directory) / f"live-job-{os.getpid() if pid is None else pid}.json"


def write_live_job(state: dict[str, Any]) -> None:
    path = live_job_path()
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)  # a scrape never reads half a file


def finish_live_job() -> None:
    """Mark this process's live job finished: its final values stay scrapeable for a grace period
    (so a 15 s scrape still sees the last loss and the final validation loss), then go."""
    path = live_job_path()
    if path is None:
        return
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    write_live_job({**state, "finished_at": time.time()})


def clear_live_job(pid: int | None = None) -> None:
    path = live_job_path(pid)
    if path is not None:
        path.unlink(missing_ok=True)


class LiveJobCollector:
    """Gauges of the jobs running now, from the live-job files of this worker's processes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        states = []
        now = time.time()
        for path in sorted(self.directory.glob(LIVE_JOB_GLOB)):
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):  # removed or replaced between glob and read
                continue
            if now - state.get("finished_at", now) > LIVE_JOB_GRACE_SECONDS:
                path.unlink(missing_ok=True)
                continue
            states.append(state)
        if not states:
            return
        for metric, doc, key, labels in LIVE_JOB_GAUGES:
            family = GaugeMetricFamily(metric, doc, labels=list(labels))
            for st in states:
                if st.get(key) is not None:
                    family.add_metric([str(st[label]) for label in labels], float(st[key]))
            yield family
