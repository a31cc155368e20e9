"""The real stack for the dashboard and metrics tests, one per test: a private redis-server for
the session, then per test a fresh SQLite database, an API key, a uvicorn API and a Celery worker
(`loraq worker`) on a queue of its own. A fresh stack per test keeps counters exact (jobs finished,
steps, requests). Built on the process helpers of tests/e2e/procs.py; imported by the conftests
of tests/dashboard and tests/metrics."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.e2e.procs import ROOT, Service, clean_env, free_port, stop_process, wait_for
from tests.servers import api_ready, start_redis


@pytest.fixture(scope="session")
def stack_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def stack(tmp_path: Path, stack_redis_url: str, request: pytest.FixtureRequest) -> Iterator[Service]:
    data_dir = tmp_path / "var"
    data_dir.mkdir()
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'loraq.db'}"
    env = clean_env(
        LORAQ_DATA_DIR=str(data_dir),
        LORAQ_DATABASE_URL=db_url,
        LORAQ_REDIS_URL=stack_redis_url,
        LORAQ_PORT=str(port),
        LORAQ_WORKER_QUEUE=f"dash-{secrets.token_hex(4)}",
        LORAQ_WORKER_METRICS_PORT="0",  # a free port; the registry entry says which
        LORAQ_INFERENCE_QUEUE=f"chat-{secrets.token_hex(4)}",  # `svc.start_inference()` serves it
        LORAQ_INFERENCE_METRICS_PORT="0",
        LORAQ_CHECKPOINT_EVERY="4",
        LORAQ_HEARTBEAT_SECONDS="1",
        # a job planned past it fails in the worker (the browser test's failed job: bad files and
        # short max_seq_len are refused at submit)
        LORAQ_JOB_MAX_STEPS="5000",
    )
    migrate = "import sys; from service.db.migrate import upgrade_head; upgrade_head(sys.argv[1])"
    subprocess.run([sys.executable, "-c", migrate, db_url], env=env, cwd=ROOT, check=True)
    keys = subprocess.run(
        [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", "dashboard"],
        env=env, cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    key = keys.stdout.strip().splitlines()[-1]
    logs = {"api": tmp_path / "api.log", "worker": tmp_path / "worker.log"}
    svc = Service(url=f"http://127.0.0.1:{port}", key=key, env=env, data_dir=data_dir, logs=logs)
    try:
        svc.procs["api"] = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
             "--host", "127.0.0.1", "--port", str(port), "--no-access-log"],
            env=env, cwd=ROOT, stdout=logs["api"].open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

        wait_for(lambda: api_ready(svc.url), "API", 60, svc.procs["api"])
        svc.start_worker()
        yield svc
    finally:
        for proc in list(svc.procs.values()):
            stop_process(proc)
        rep = getattr(request.node, "rep_call", None)
        if rep is not None and rep.failed:
            for name in logs:
                print(f"--- {name} log (tail)\n{svc.log_text(name)[-6000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep
