"""Helpers to run the service's processes in tests: ports, waits, clean environments, shutdown."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service.job_status import TERMINAL
from tests.servers import api_ready
from tests.servers import stop as stop_process

__all__ = ["stop_process"]

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    check: Callable[[], bool], what: str, timeout: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what}: not ready after {timeout}s")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@dataclass
class Service:
    """A running API + worker pair and what a test needs to talk to them."""

    url: str
    key: str
    env: dict[str, str]
    data_dir: Path
    logs: dict[str, Path]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def client(self, key: str | None = None) -> httpx.Client:
        auth = {"Authorization": f"Bearer {key or self.key}"}
        return httpx.Client(base_url=self.url + "/v1", headers=auth, timeout=30)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = dict(self.env, LORAQ_URL=self.url, LORAQ_API_KEY=self.key)
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", *args], env=env, cwd=ROOT, capture_output=True, text=True
        )
        if check and out.returncode != 0:
            raise AssertionError(f"loraq {' '.join(args)} -> {out.returncode}\n{out.stdout}\n{out.stderr}")
        return out

    def new_key(self, tenant: str) -> str:
        """A key for `tenant` (created if new), made with `loraq keys create` on the database."""
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", tenant],
            env=self.env, cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[-1]

    def log_text(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace") if self.logs[name].exists() else ""

    def wait_job(
        self, job_id: str, statuses: set[str], timeout: float = 240, key: str | None = None
    ) -> dict[str, Any]:
        """Poll the job until its status is in `statuses`; returns the job object."""
        seen: list[str] = []
        with self.client(key) as c:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                job: dict[str, Any] = c.get(f"/fine_tuning/jobs/{job_id}").json()
                if not seen or seen[-1] != job["status"]:
                    seen.append(job["status"])
                if job["status"] in statuses:
                    job["_seen"] = seen
                    return job
                if job["status"] in TERMINAL:
                    raise AssertionError(f"job ended {job['status']} (wanted {statuses}): {job.get('error')}")
                time.sleep(0.05)
        raise AssertionError(
            f"job {job_id} stuck; statuses seen {seen}\n--- worker log\n{self.log_text('worker')}"
        )

    def stop_worker(self) -> None:
        stop_process(self.procs.pop("worker"))

    def start_worker(self) -> None:
        self.procs["worker"] = start_worker(self.env, self.logs["worker"])

    def start_inference(self) -> None:
        """A `loraq inference` worker (chat completions) next to the Celery worker, once."""
        if "inference" not in self.procs:
            self.logs.setdefault("inference", self.logs["worker"].with_name("inference.log"))
            self.procs["inference"] = start_inference_worker(self.env, self.logs["inference"])


def start_worker(env: dict[str, str], log: Path, prefix: Sequence[str] = ()) -> subprocess.Popen[bytes]:
    return _start_logged(["worker", "--loglevel", "INFO"], env, log, b" ready.", "celery worker", prefix)


def start_inference_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return _start_logged(["inference"], env, log, b" ready on queue ", "inference worker")


def _start_logged(
    args: list[str], env: dict[str, str], log: Path, ready_line: bytes, what: str, prefix: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """`loraq <args>` (run under `prefix`: another network namespace, tests/netns.py) with its
    output appended to `log`; returns once `ready_line` appears there."""
    start = log.stat().st_size if log.exists() else 0
    out = log.open("ab")
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "service.cli", *args],
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def ready() -> bool:
        with log.open("rb") as fh:
            fh.seek(start)
            return ready_line in fh.read()

    wait_for(ready, what, 120, proc)
    return proc


@contextmanager
def running_service(tmp: Path, db_url: str, redis_url: str, **env_extra: str) -> Iterator[Service]:
    """Migrations applied, an API key made with `loraq keys create`, a uvicorn API process and a
    `loraq worker` process (Celery, solo pool) on queues private to this service, with a clean
    `LORAQ_*` environment plus `env_extra`; everything stopped when the block ends."""
    data_dir = tmp / "var"
    data_dir.mkdir(parents=True)
    port = free_port()
    env = clean_env(
        LORAQ_DATA_DIR=str(data_dir),
        LORAQ_DATABASE_URL=db_url,
        LORAQ_REDIS_URL=redis_url,
        LORAQ_PORT=str(port),
        # A queue per service: the SQLite service's worker never takes the PostgreSQL one's jobs.
        LORAQ_WORKER_QUEUE=f"e2e-{secrets.token_hex(4)}",
        LORAQ_INFERENCE_QUEUE=f"chat-{secrets.token_hex(4)}",
        LORAQ_INFERENCE_METRICS_PORT=str(free_port()),
        LORAQ_CHECKPOINT_EVERY="4",
        LORAQ_HEARTBEAT_SECONDS="1",
        **env_extra,
    )
    migrate = "import sys; from service.db.migrate import upgrade_head; upgrade_head(sys.argv[1])"
    subprocess.run([sys.executable, "-c", migrate, db_url], env=env, cwd=ROOT, check=True)
    logs = {"api": tmp / "api.log", "worker": tmp / "worker.log"}
    svc = Service(url=f"http://127.0.0.1:{port}", key="", env=env, data_dir=data_dir, logs=logs)
    svc.key = svc.new_key("e2e")
    try:
        api = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
             "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
            env=env, cwd=ROOT, stdout=logs["api"].open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        svc.procs["api"] = api

        wait_for(lambda: api_ready(svc.url), "API", 60, api)
        svc.start_worker()
        yield svc
    finally:
        for proc in list(svc.procs.values()):
            stop_process(proc)
