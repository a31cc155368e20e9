"""A real stack for fault injection: a private `redis-server` (restartable, on a free port), a
fresh PostgreSQL database, a uvicorn API (whose reaper loop ticks every half second) and Celery
workers started and signalled as separate process groups.

Timings are short so a fault is detected in seconds: workers heartbeat every 0.5 s, a job whose
heartbeat is 5 s old is re-queued, a queued job missing from Redis for 1 s is re-sent, and a
checkpoint is written every 3 steps. One stack serves the module (starting a worker imports
torch: several seconds on a busy 2-core machine); each test works on its own jobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.job_status import TERMINAL
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import ROOT, clean_env, free_port, start_worker, stop_process, wait_for
from tests.servers import api_ready, create_pg_database, drop_pg_database, start_redis

HEARTBEAT_TIMEOUT_S = 5.0
CHECKPOINT_EVERY = 3


@dataclass
class Stack:
    url: str
    key: str
    env: dict[str, str]
    db_url: str
    tmp: Path
    redis_port: int
    redis: subprocess.Popen[bytes] | None = None
    api: subprocess.Popen[bytes] | None = None
    workers: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    file_id: str = ""

    # ------------------------------------------------------------------ processes
    def start_redis(self) -> None:
        self.redis = start_redis(self.tmp / "redis", port=self.redis_port).proc

    def kill_redis(self) -> None:
        """SIGKILL: no persistence, so every queued message is gone."""
        assert self.redis is not None
        stop_process(self.redis, signal.SIGKILL)
        self.redis = None

    def start_worker(self, prefix: Sequence[str] = (), **extra_env: str) -> subprocess.Popen[bytes]:
        """A worker with `extra_env` over the stack's settings, run under `prefix` (tests/netns.py)."""
        log = self.tmp / f"worker-{len(self.workers)}.log"
        proc = start_worker({**self.env, **extra_env}, log, prefix)
        self.workers.append((proc, log))
        return proc

    def alive_workers(self) -> list[subprocess.Popen[bytes]]:
        return [p for p, _ in self.workers if p.poll() is None]

    def ensure_workers(self, n: int) -> None:
        while len(self.alive_workers()) < n:
            self.start_worker()

    def only_workers(self, n: int) -> list[subprocess.Popen[bytes]]:
        """Exactly `n` live workers (extra ones stopped with SIGTERM, missing ones started)."""
        for proc in self.alive_workers()[n:]:
            stop_process(proc, grace=20)
        self.ensure_workers(n)
        return self.alive_workers()

    def queue_length(self) -> int:
        import redis

        client = redis.Redis.from_url(self.env["LORAQ_REDIS_URL"])
        try:
            return int(client.llen(self.env["LORAQ_WORKER_QUEUE"]))
        finally:
            client.close()

    def worker_log(self, proc: subprocess.Popen[bytes]) -> str:
        log = next(path for p, path in self.workers if p is proc)
        return log.read_text(errors="replace")

    def worker_running(self, job_id: str) -> subprocess.Popen[bytes]:
        """The worker process whose attempt holds the job (`worker_id` ends with its pid)."""
        worker_id = self.job(job_id)["worker_id"]
        pid = int(worker_id.rsplit(":", 1)[1])
        return next(p for p, _ in self.workers if p.pid == pid)

    def logs(self) -> str:
        parts = [f"--- api\n{(self.tmp / 'api.log').read_text(errors='replace')[-4000:]}"]
        for proc, path in self.workers:
            parts.append(f"--- {path.name} (pid {proc.pid})\n{path.read_text(errors='replace')[-4000:]}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ API
    def start_api(self, tenant: str) -> None:
        """A key of a new tenant, the API (uvicorn on `url`'s port, its reaper ticking) and that
        tenant's training file (`file_id`)."""
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", tenant],
            env=self.env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        self.key = out.stdout.strip().splitlines()[-1]
        self.api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
             "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--no-access-log"],
            env=self.env, cwd=ROOT, stdout=(self.tmp / "api.log").open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        wait_for(lambda: api_ready(self.url), "API", 60, self.api)
        with self.client() as c:
            files = {"file": ("train.jsonl", chat_lines(16))}
            r = c.post("/files", data={"purpose": "fine-tune"}, files=files)
            assert r.status_code == 200, r.text
            self.file_id = r.json()["id"]

    def new_tenant(self, name: str, examples: int = 16) -> tuple[httpx.Client, str]:
        """A client (base URL `/v1`) with a key of a new tenant, and a training file it uploaded."""
        tenant = f"{name}-{secrets.token_hex(3)}"
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", tenant],
            env=self.env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        key = out.stdout.strip().splitlines()[-1]
        client = httpx.Client(
            base_url=self.url + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        files = {"file": ("train.jsonl", chat_lines(examples))}
        r = client.post("/files", data={"purpose": "fine-tune"}, files=files)
        assert r.status_code == 200, r.text
        return client, str(r.json()["id"])

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url + "/v1", headers={"Authorization": f"Bearer {self.key}"}, timeout=30
        )

    def submit(self, n_epochs: int, seed: int = 7) -> str:
        body = {
            "model": "tiny-llama",
            "training_file": self.file_id,
            "suffix": "rel",
            "seed": seed,
            "hyperparameters": {"n_epochs": n_epochs, "batch_size": 4, "learning_rate_multiplier": 5.0},
            "lora": {"r": 4, "alpha": 8},
            "max_seq_len": 128,
            "packing": False,  # one example per row: step counts and run lengths as planned
        }
        with self.client() as c:
            r = c.post("/fine_tuning/jobs", json=body)
            assert r.status_code == 200, r.text
            return str(r.json()["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        with self.client() as c:
            job: dict[str, Any] = c.get(f"/fine_tuning/jobs/{job_id}").json()
            return job

    def wait(self, job_id: str, statuses: set[str], timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["status"] in statuses:
                return job
            if job["status"] in TERMINAL:
                raise AssertionError(f"job {job_id} ended {job['status']}: {job.get('error')}\n{self.logs()}")
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} stuck in {job.get('status')}\n{self.logs()}")

    def wait_checkpoint(self, job_id: str, timeout: float = 120) -> int:
        """Block until the job (still running) has a registered checkpoint; its step."""
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while time.monotonic() < deadline:
                data = c.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"]
                if data:
                    return int(data[0]["step_number"])
                time.sleep(0.05)
        raise AssertionError(f"job {job_id}: no checkpoint\n{self.logs()}")

    # ------------------------------------------------------------------ database
    def metric_steps(self, job_id: str) -> list[int]:
        from service.db.models import JobMetric
        from service.db.session import session_scope

        with session_scope(self.db_url) as s:
            return list(s.scalars(select(JobMetric.step).where(JobMetric.job_id == job_id)))

    def losses(self, job_id: str) -> dict[int, float]:
        from service.db.models import JobMetric
        from service.db.session import session_scope

        with session_scope(self.db_url) as s:
            rows = s.execute(
                select(JobMetric.step, JobMetric.train_loss).where(JobMetric.job_id == job_id)
            ).all()
            return {int(st): float(loss) for st, loss in rows}

    def events(self, job_id: str) -> list[str]:
        from service.db.models import JobEvent
        from service.db.session import session_scope

        with session_scope(self.db_url) as s:
            query = select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)
            return list(s.scalars(query))

    def adapter_bytes(self, job_id: str) -> bytes:
        with self.client() as c:
            r = c.get(f"/fine_tuning/jobs/{job_id}/adapter")  # the API re-checks the stored sha256
            assert r.status_code == 200, r.text
            return r.content

    def assert_succeeded_once(self, job_id: str, *, attempts: int | None = None) -> dict[str, Any]:
        """The end state every fault must leave: succeeded, exactly once; every step's metrics
        stored exactly once; one adapter artifact whose bytes match its recorded sha256."""
        from service.db.models import Artifact, Job
        from service.db.session import session_scope

        job = self.wait(job_id, {"succeeded"})
        assert job["fine_tuned_model"] == f"ft:tiny-llama:rel:{job_id}"
        events = self.events(job_id)
        assert events.count("The job has successfully completed") == 1, events
        steps = self.metric_steps(job_id)
        total = job["progress"]["total_steps"]
        assert sorted(steps) == list(range(1, total + 1)), f"duplicate or missing steps: {sorted(steps)}"
        with session_scope(self.db_url) as s:
            arts = s.execute(
                select(Artifact.kind, Artifact.sha256).where(
                    Artifact.job_id == job_id, Artifact.kind == "adapter"
                )
            ).all()
            db_job = s.scalars(select(Job).where(Job.id == job_id)).one()
            assert s.scalar(select(func.count()).select_from(Artifact).where(Artifact.job_id == job_id)) == 2
        assert len(arts) == 1, arts
        assert hashlib.sha256(self.adapter_bytes(job_id)).hexdigest() == arts[0].sha256
        if attempts is not None:
            assert db_job.attempt == attempts, (db_job.attempt, events)
        return job


@contextlib.contextmanager
def running_stack(tmp: Path, **extra_env: str) -> Iterator[Stack]:
    """A fresh PostgreSQL database, a private redis-server and the API (with `extra_env` on top of
    the stack's settings), in `tmp`; the workers a test starts are stopped after it."""
    from service.db.migrate import upgrade_head
    from service.db.session import dispose_engines

    pg_name, db_url = create_pg_database("loraq_rel")
    redis_port, api_port = free_port(), free_port()
    env = clean_env(
        LORAQ_DATA_DIR=str(tmp / "var"),
        LORAQ_DATABASE_URL=db_url,
        LORAQ_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        LORAQ_PORT=str(api_port),
        LORAQ_WORKER_QUEUE=f"rel-{secrets.token_hex(4)}",
        LORAQ_SECRET_KEY=secrets.token_hex(32),
        LORAQ_CHECKPOINT_EVERY=str(CHECKPOINT_EVERY),
        # one cadence the tests reason about (every 3 steps); epoch-end checkpoints (4 steps an
        # epoch here) would double the checkpoint work on a loaded 2-core machine
        LORAQ_CHECKPOINT_EACH_EPOCH="0",
        LORAQ_HEARTBEAT_SECONDS="0.5",
        LORAQ_HEARTBEAT_TIMEOUT_SECONDS=str(HEARTBEAT_TIMEOUT_S),
        LORAQ_REAPER_INTERVAL_SECONDS="0.5",
        LORAQ_RECONCILE_GRACE_SECONDS="1",
        LORAQ_MAX_ATTEMPTS="3",
        LORAQ_MAX_QUEUED_JOBS_PER_TENANT="0",
        LORAQ_RATE_LIMIT_PER_MINUTE="0",
        **extra_env,
    )
    (tmp / "var").mkdir()
    stack = Stack(
        url=f"http://127.0.0.1:{api_port}", key="", env=env, db_url=db_url, tmp=tmp, redis_port=redis_port
    )
    try:
        upgrade_head(db_url)
        stack.start_redis()
        stack.start_api("rel")
        yield stack
    finally:
        for proc, _ in stack.workers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)  # a test that failed between STOP and CONT
            stop_process(proc, grace=10)
        for maybe in (stack.api, stack.redis):
            if maybe is not None:
                stop_process(maybe)
        dispose_engines()
        drop_pg_database(pg_name)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("reliability")) as stack:
        yield stack
