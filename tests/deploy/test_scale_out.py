"""Scale-out on one machine: one API, two workers on different queues, one Redis, one PostgreSQL.

Worker "h100" is started the way a GPU host starts it (`loraq worker --gpus 0 --queue h100`, the
per-GPU launcher); worker "cpu" as a plain `loraq worker --queue cpu`. Six jobs, three per queue,
must each run on their queue's worker (the job's `worker_id` says which host and GPU ran it) and
succeed; a seventh job for a queue nobody serves must stay queued meanwhile.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.datasets import chat_lines
from tests.e2e.procs import ROOT, TERMINAL, clean_env, free_port, stop_process, wait_for
from tests.servers import api_ready


def _ready(log: Path, count: int) -> bool:
    return log.exists() and log.read_bytes().count(b" ready.") >= count


class Stack:
    def __init__(self, tmp: Path, db_url: str, redis_url: str) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = clean_env(
            LORAQ_DATA_DIR=str(tmp / "var"),
            LORAQ_DATABASE_URL=db_url,
            LORAQ_REDIS_URL=redis_url,
            LORAQ_PORT=str(self.port),
            LORAQ_WORKER_METRICS_PORT="0",  # two workers on one machine: each picks a free port
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        self.logs[name] = self.tmp / f"{name}.log"
        proc = subprocess.Popen(
            argv, env=self.env, cwd=ROOT, stdout=self.logs[name].open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        self.procs[name] = proc
        return proc

    def logs_tail(self) -> str:
        return "\n".join(f"--- {n}\n{p.read_text(errors='replace')[-4000:]}" for n, p in self.logs.items())


@pytest.fixture
def stack(tmp_path: Path, pg_db_url: str, redis_url: str) -> Iterator[Stack]:
    s = Stack(tmp_path, pg_db_url, redis_url)
    migrate = "import sys; from service.db.migrate import upgrade_head; upgrade_head(sys.argv[1])"
    subprocess.run([sys.executable, "-c", migrate, pg_db_url], env=s.env, cwd=ROOT, check=True)
    try:
        cli = [sys.executable, "-m", "service.cli"]
        api = s.spawn("api", [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
                              "--host", "127.0.0.1", "--port", str(s.port), "--no-access-log"])  # fmt: skip
        gpu = s.spawn("worker-h100", [*cli, "worker", "--gpus", "0", "--queue", "h100"])
        cpu = s.spawn("worker-cpu", [*cli, "worker", "--queue", "cpu"])
        # a two-GPU slot (queue h100-x2): its jobs run under torchrun, 2 gloo ranks on this CPU
        pair = s.spawn(
            "worker-h100x2", [*cli, "worker", "--gpus", "0,1", "--gpus-per-job", "2", "--queue", "h100"]
        )

        wait_for(lambda: api_ready(s.url), "API", 60, api)
        wait_for(lambda: _ready(s.logs["worker-h100"], 1), "h100 worker", 180, gpu)
        wait_for(lambda: _ready(s.logs["worker-cpu"], 1), "cpu worker", 180, cpu)
        wait_for(lambda: _ready(s.logs["worker-h100x2"], 1), "h100-x2 worker", 180, pair)
        yield s
    finally:
        for proc in s.procs.values():
            stop_process(proc)


def test_six_jobs_routed_by_queue_each_run_on_its_worker(stack: Stack) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", "scale"],
        env=stack.env, cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    key = out.stdout.strip().splitlines()[-1]
    client = httpx.Client(base_url=stack.url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    try:
        upload = client.post(
            "/files", data={"purpose": "fine-tune"}, files={"file": ("train.jsonl", chat_lines(6))}
        )
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]

        def create(queue: str, n_gpus: int = 1) -> dict[str, Any]:
            body = {
                "model": "tiny-llama",
                "training_file": file_id,
                "hyperparameters": {"n_epochs": 1, "batch_size": 3},
                "max_seq_len": 128,
                "queue": queue,
                "n_gpus": n_gpus,
            }
            r = client.post("/fine_tuning/jobs", json=body)
            assert r.status_code == 200, r.text
            job: dict[str, Any] = r.json()
            assert (job["queue"], job["n_gpus"]) == (queue, n_gpus)
            return job

        jobs = {create(q)["id"]: q for q in ["h100", "cpu"] * 3}
        # made with the CLI (`loraq jobs create --queue h100 --n-gpus 2`); only the two-GPU slot may take it
        made = subprocess.run(
            [sys.executable, "-m", "service.cli", "jobs", "create", "--model", "tiny-llama",
             "--training-file", file_id, "--n-epochs", "1", "--batch-size", "3", "--max-seq-len", "128",
             "--queue", "h100", "--n-gpus", "2"],
            env=dict(stack.env, LORAQ_URL=stack.url, LORAQ_API_KEY=key, COLUMNS="200"),
            cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        multi_job = json.loads(made.stdout)
        assert (multi_job["queue"], multi_job["n_gpus"]) == ("h100", 2)
        multi = multi_job["id"]
        jobs[multi] = "h100-x2"
        # no worker consumes "a100" or "cpu-x4": refused at submit, naming the field
        for queue, n_gpus, param in (("a100", 1, "queue"), ("cpu", 4, "n_gpus")):
            body = {"model": "tiny-llama", "training_file": file_id, "queue": queue, "n_gpus": n_gpus}
            refused = client.post("/fine_tuning/jobs", json=body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text

        finished: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + 400
        while len(finished) < len(jobs) and time.monotonic() < deadline:
            for job_id in jobs.keys() - finished.keys():
                job = client.get(f"/fine_tuning/jobs/{job_id}").json()
                if job["status"] in TERMINAL:
                    finished[job_id] = job
            time.sleep(0.5)
        assert len(finished) == len(jobs), f"unfinished after 400 s\n{stack.logs_tail()}"

        ran_on: dict[str, set[str]] = {"h100": set(), "cpu": set(), "h100-x2": set()}
        expected_where = {"h100": "gpu0", "cpu": "cpu", "h100-x2": "gpu0,1"}
        for job_id, queue in jobs.items():
            job = finished[job_id]
            assert job["status"] == "succeeded", (job["error"], stack.logs_tail())
            host, where, pid = job["worker_id"].split(":")
            assert host == socket.gethostname()
            # the launcher pins each worker to its GPUs; the plain worker has none
            assert where == expected_where[queue], job["worker_id"]
            ran_on[queue].add(pid)
        # one worker process per queue, three different processes
        assert all(len(pids) == 1 for pids in ran_on.values())
        assert len(set.union(*ran_on.values())) == 3

        # The two-rank job reported one loss curve: steps 1..N once each (rank 0 only).
        events = client.get(f"/fine_tuning/jobs/{multi}/events", params={"limit": 100}).json()["data"]
        steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
        assert sorted(steps) == list(range(1, finished[multi]["progress"]["total_steps"] + 1)), steps

    finally:
        client.close()
