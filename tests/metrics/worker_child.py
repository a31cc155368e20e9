"""Run as a script by test_worker_metrics: a worker-like process tree for the metrics endpoint.

The main process starts the worker metrics server (port 0 = free) and prints `PORT <n> NODE <id>`,
then forks a child that runs a fake job through the hooks `worker.runner`/`worker.tasks` call,
the way a Celery prefork pool child would: three steps, then it prints `MID` and waits. Each line
on stdin moves on: the first lets the child finish the job and exit (`CHILD <exit code>`), the
second marks the child dead as Celery's worker_process_shutdown hook does (`MARKED`), the third
stops the server.
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

from worker import metrics
from worker.engine.types import StepMetrics
from worker.metrics import server as metrics_server


def run_job(job_id: str, mid: Any, go: Any) -> None:
    metrics.job_started(job_id, model="tiny-llama", max_grad_norm=1.0)
    for step, grad_norm in ((1, 2.5), (2, 0.5), (3, 1.5)):  # steps 1 and 3 exceed max_grad_norm
        m = StepMetrics(
            step=step, total_steps=3, epoch=step / 3, train_loss=4.0 - step, lr=1e-4, grad_norm=grad_norm,
            tokens=100, trained_tokens=100 * step, tokens_per_s=1000.0 + step, step_seconds=0.1 * step,
            eta_seconds=0.0, valid_loss=2.5 if step == 2 else None,
        )  # fmt: skip
        metrics.observe_step(job_id, m)
    mid.set()
    go.wait(30)
    metrics.job_finished(job_id, "succeeded")


if __name__ == "__main__":
    server = metrics_server.start_worker_metrics(port=0)
    print(f"PORT {server.port} NODE {server.node}", flush=True)
    ctx = multiprocessing.get_context("fork")
    mid, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=run_job, args=(sys.argv[1], mid, go))
    child.start()
    mid.wait(30)
    print("MID", flush=True)
    sys.stdin.readline()
    go.set()
    child.join()
    print(f"CHILD {child.exitcode}", flush=True)
    sys.stdin.readline()
    metrics_server.mark_child_dead(child.pid or 0)
    print("MARKED", flush=True)
    sys.stdin.readline()
    server.stop()
