"""Multiprocess safety for real: a Celery worker with a *prefork* pool runs a tiny-llama job in a
pool child while the main process serves /metrics; the child's training series reach the scrape
through PROMETHEUS_MULTIPROC_DIR. (`loraq worker` itself uses the solo pool; prefork is what a
plain `celery worker` gives, and what the multiprocess mode exists for.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from service import worker_registry
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import ROOT, Service, stop_process, wait_for


def test_prefork_child_metrics_are_served_by_the_main_process(stack: Service, tmp_path: Path) -> None:
    svc = stack
    svc.stop_worker()  # replace the solo-pool worker with a prefork one on the same queue
    log = tmp_path / "prefork.log"
    argv = [sys.executable, "-m", "celery", "-A", "worker.celery_app:celery_app", "worker", "--pool=prefork",
            "--concurrency=1", f"--queues={svc.env['LORAQ_WORKER_QUEUE']}", "--without-gossip",
            "--without-mingle", "--loglevel=INFO"]  # fmt: skip
    proc = subprocess.Popen(argv, env=svc.env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        wait_for(lambda: b" ready." in log.read_bytes(), "prefork celery worker", 120, proc)
        rds = redis.Redis.from_url(svc.env["LORAQ_REDIS_URL"])
        entries: list[dict[str, object]] = []

        def registered() -> bool:
            entries[:] = [w for w in worker_registry.list_workers(rds) if w["pid"] == proc.pid]
            return bool(entries)

        wait_for(registered, "registry entry of the prefork worker", 30)
        port = entries[0]["metrics_port"]

        with svc.client() as c:
            up = c.post("/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", chat_lines(16))})
            body = {"model": "tiny-llama", "training_file": up.json()["id"], "packing": False,
                    "hyperparameters": {"n_epochs": 2, "batch_size": 4}}  # fmt: skip
            job_id = c.post("/fine_tuning/jobs", json=body).json()["id"]
        done = svc.wait_job(job_id, {"succeeded"})
        steps = done["progress"]["total_steps"]
        assert steps == 8

        # The job ran in a pool child, not in the process that serves /metrics.
        multiproc = svc.data_dir / "prometheus" / f"worker-{proc.pid}"
        (live,) = multiproc.glob("live-job-*.json")  # written by the process that trained
        assert json.loads(live.read_text())["job_id"] == job_id
        trainer = int(live.stem.removeprefix("live-job-"))
        assert trainer != proc.pid
        assert (multiproc / f"counter_{trainer}.db").exists()

        # the task counts the attempt's outcome after the runner stores it: the scrape may lag
        # the job's status for a moment
        texts: list[str] = []

        def counted() -> bool:
            texts[:] = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text]
            return 'loraq_jobs_finished_total{outcome="succeeded"}' in texts[0]

        wait_for(counted, "the finished job's counter in the main process's /metrics", 20, proc)
        text = texts[0]
    finally:
        stop_process(proc)
        if proc.returncode not in (0, None):
            print(log.read_text(errors="replace")[-4000:])
    got = {(s.name, json.dumps(s.labels, sort_keys=True)): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    assert got[("loraq_train_steps_total", "{}")] == steps
    assert got[("loraq_train_step_seconds_count", "{}")] == steps
    assert got[("loraq_jobs_finished_total", json.dumps({"outcome": "succeeded"}))] == 1
    assert got[("loraq_job_duration_seconds_count", json.dumps({"outcome": "succeeded"}))] == 1
    loss = got[("loraq_train_loss", json.dumps({"job_id": job_id, "model": "tiny-llama"}, sort_keys=True))]
    assert 0 < loss < 20
    assert got[("loraq_train_step", json.dumps({"job_id": job_id}))] == steps
