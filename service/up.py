"""`loraq up`: the whole service on one machine, in the foreground.

Before starting anything it takes an exclusive lock on its data dir (`up.lock`) and checks that
the API port is free, so a second `loraq up` exits at once, naming the cause, and touches nothing
of the first. Then it starts, in order: a private `redis-server` (only when `LORAQ_REDIS_URL` is
unset; append-only file under the data dir), database migrations, the API key, the API (uvicorn),
one Celery worker and one inference worker (`loraq inference`, chat completions). It prints
"Loraq is up" once the API answers and both workers have registered (the worker registry entry,
the inference heartbeat), which takes tens of seconds (they import torch); the inference worker is
marked as starting from its spawn, so a chat request or a dry run sent meanwhile waits for it.
service/supervisor.py watches the children: one that exits is restarted
with backoff, a crash loop stops everything with a non-zero exit, and children die with this
process even on `kill -9`. An exit of the API or a worker while Redis or the database does not
answer is an outage, not a crash: restarted, never counted as part of a crash loop. The
children's PIDs are in `<data_dir>/up.pids.json` while they run.

Without `LORAQ_API_KEY`, the first start creates one admin key for tenant `default` and stores it
(with its hash as the database holds it) in `<data_dir>/admin_key.json`, readable by the owner
only; later starts reuse it and print where it is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING

import httpx
from redis import Redis
from redis.exceptions import RedisError

from service.redis_client import redis_client
from service.settings import Settings
from service.supervisor import (
    RESTARTS_FILE,
    Child,
    CrashLoopError,
    Supervisor,
    describe_exit,
    free_port,
    log_tail,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["Supervisor", "free_port", "run_up"]

READY_TIMEOUT_SECONDS = 120.0
# The children that register once they serve, and how the banner names them: `loraq up` says
# "Loraq is up" once all of them have, so nothing a user does first meets a worker still starting.
WORKERS = {"worker": "the worker", "inference": "the inference worker"}
REDIS_ERRORS = (RedisError, OSError)
PID_FILE = "up.pids.json"
LOCK_FILE = "up.lock"
KEY_FILE = "admin_key.json"
POLL_SECONDS = 0.2


class UpError(RuntimeError):
    """`loraq up` could not start; the message says which part, why, and what to do."""


@contextlib.contextmanager
def data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `<data_dir>/up.lock` (released by the kernel however this
    process ends); raise `UpError` naming the holder's pid when another `loraq up` has it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / LOCK_FILE
    fh: IO[str] = open(path, "a+")  # noqa: SIM115 - held until the context ends
    try:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            raise UpError(
                f"data dir {data_dir} is used by pid {holder} (another `loraq up`): stop that one "
                "first, or give this one its own LORAQ_DATA_DIR"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        yield
    finally:
        fh.close()


def check_port_free(host: str, port: int) -> None:
    """Bind the API's address as uvicorn will (SO_REUSEADDR): `UpError` if something holds it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                why = f"cannot listen on {host}:{port}: {e.strerror}"
                raise UpError(f"{why}; set LORAQ_HOST and LORAQ_PORT") from None
            raise UpError(
                f"port {port} in use on {host}: stop what listens there, or set LORAQ_PORT to a free port"
            ) from None


def start_redis(sup: Supervisor, settings: Settings, env: dict[str, str]) -> str:
    """Start a private redis-server on a free loopback port; return its URL once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise UpError(
            "LORAQ_REDIS_URL is unset and no `redis-server` binary is on PATH: "
            "install Redis (apt-get install redis-server) or set LORAQ_REDIS_URL"
        )
    redis_dir = settings.resolved_data_dir / "redis"
    redis_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [
        binary,
        "--bind", "127.0.0.1",
        "--port", str(port),
        "--dir", str(redis_dir),
        # Durable enough for a single machine: the queue survives a restart of `loraq up`.
        "--appendonly", "yes",
        "--save", "",
        "--protected-mode", "yes",
    ]  # fmt: skip
    child = sup.spawn("redis", argv, env=env, log_path=redis_dir / "redis.log")
    url = f"redis://127.0.0.1:{port}/0"
    _wait_until(lambda: _redis_ping(settings, url), child, "redis-server", timeout=20.0)
    return url


def _redis_ping(settings: Settings, url: str) -> bool:
    from service.redis_client import REDIS_OUTAGE, redis_client

    try:
        return bool(redis_client(settings, url=url, socket_timeout=0.5).ping())
    except REDIS_OUTAGE:
        return False


def _wait_until(ready: Callable[[], bool], child: Child, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise UpError(
                f"{what} {describe_exit(child.proc.returncode)} while starting; the end of its log "
                f"{child.log_path}:\n{log_tail(child.log_path)}"
            )
        if ready():
            return
        time.sleep(0.1)
    raise UpError(f"{what} was not ready after {timeout:.0f}s")


def _http_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def prepare_database_and_key(settings: Settings) -> tuple[str, str]:
    """Run migrations and make sure an admin key works; return (key, what to print about it)."""
    from service.auth import DEFAULT_TENANT, ensure_bootstrap_key
    from service.db.migrate import upgrade_head
    from service.db.session import session_scope

    upgrade_head(settings.resolved_database_url)
    path = settings.resolved_data_dir / KEY_FILE
    with session_scope() as session:
        if settings.api_key:
            ensure_bootstrap_key(session, settings.api_key)
            return settings.api_key, f"API key (LORAQ_API_KEY, tenant {DEFAULT_TENANT}): {settings.api_key}"
        if path.exists():
            key = str(json.loads(path.read_text())["key"])
            ensure_bootstrap_key(session, key)  # a no-op unless the database is new
            return key, f"API key: in {path} (owner-only; `loraq keys create --tenant NAME` makes more)"
        key = _create_admin_key(session, path)
    return key, f"API key (generated for tenant {DEFAULT_TENANT}): {key}  (stored in {path}, owner-only)"


def _create_admin_key(session: Session, path: Path) -> str:
    """A new key for the default tenant, written to `path` (mode 0600, never overwritten) with
    the prefix and hash the database holds for it, so it can be found and revoked."""
    from service.auth import DEFAULT_TENANT, PREFIX_CHARS, create_key, hash_key

    key = create_key(session, DEFAULT_TENANT)
    record = {"tenant": DEFAULT_TENANT, "key": key, "prefix": key[:PREFIX_CHARS], "key_hash": hash_key(key)}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(record, fh, indent=1)
    return key


def child_env(settings: Settings, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        LORAQ_DATA_DIR=str(settings.resolved_data_dir),
        LORAQ_DATABASE_URL=settings.resolved_database_url,
        LORAQ_REDIS_URL=redis_url,
        LORAQ_HOST=settings.host,
        LORAQ_PORT=str(settings.port),
        PYTHONUNBUFFERED="1",
    )
    return env


def api_argv(settings: Settings) -> list[str]:
    """`loraq api`: uvicorn with the connection limits (service/api_server.py), as in the image."""
    return [sys.executable, "-m", "service.cli", "api"]


def worker_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "service.cli", "worker", "--queue", settings.worker_queue]


def inference_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "service.cli", "inference", "--queue", settings.inference_queue]


def run_up(settings: Settings, echo: Callable[[str], None] = print) -> int:
    """Check, start everything, supervise until a signal or a crash loop, stop everything.
    Returns the exit code: 0 after Ctrl-C/SIGTERM, 1 when it could not start or gave up."""
    data_dir = settings.resolved_data_dir
    try:
        with data_dir_lock(data_dir):
            check_port_free(settings.host, settings.port)
            return _run_locked(settings, data_dir, echo)
    except UpError as e:
        echo(f"loraq up: {e}")
        return 1


def _run_locked(settings: Settings, data_dir: Path, echo: Callable[[str], None]) -> int:
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(pid_file=data_dir / PID_FILE, restarts_file=data_dir / RESTARTS_FILE, echo=echo)
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)
        raise KeyboardInterrupt  # unwinds whatever step `run_up` is in, straight to `finally`

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = dict(os.environ)  # the children inherit this process's environment
        redis_url = settings.redis_url or start_redis(sup, settings, env)
        settings = settings.model_copy(update={"redis_url": redis_url})
        env = child_env(settings, redis_url)
        # Children and this process's DB helpers read the same settings from the environment.
        os.environ.update({k: env[k] for k in ("LORAQ_DATA_DIR", "LORAQ_DATABASE_URL", "LORAQ_REDIS_URL")})
        _reset_cached_settings()

        key, key_line = prepare_database_and_key(settings)
        env["LORAQ_API_KEY"] = key

        down = partial(dependency_down, settings)
        api = sup.spawn("api", api_argv(settings), env=env, log_path=logs / "api.log", dependency=down)
        sup.spawn("worker", worker_argv(settings), env=env, log_path=logs / "worker.log", dependency=down)
        sup.on_exit["worker"] = lambda _child, pid: _release_jobs_of(pid, echo)
        # chat completions are served by their own worker, never by the API
        sup.spawn(
            "inference", inference_argv(settings), env=env, log_path=logs / "inference.log", dependency=down
        )
        from service.inference import inference_worker_id, mark_starting

        registry = redis_client(settings)
        inference_id = inference_worker_id(_child(sup, "inference").pid)
        with contextlib.suppress(*REDIS_ERRORS):  # requests wait for it from now on, not once it runs
            mark_starting(registry, settings.inference_queue, inference_id)
        base = f"http://{settings.host}:{settings.port}"
        _wait_until(lambda: _http_ready(f"{base}/readyz"), api, "the API", timeout=READY_TIMEOUT_SECONDS)
        echo(f"The API answers on {base}; waiting for {' and '.join(WORKERS.values())} (they import torch)")

        waiting = list(WORKERS)
        since = time.monotonic()
        while True:
            sup.poll()
            if waiting:
                waiting = [name for name in waiting if not registered(settings, registry, sup, name)]
                if not waiting or time.monotonic() - since > READY_TIMEOUT_SECONDS:
                    echo(f"Loraq is up: {base}  (OpenAI base_url {base}/v1, docs {base}/docs)")
                    for name in waiting:
                        echo(
                            f"loraq up: {WORKERS[name]} has not registered after {READY_TIMEOUT_SECONDS:g}s; "
                            f"its log: {_child(sup, name).log_path}"
                        )
                    echo(key_line)
                    echo(f"Data: {data_dir}   Redis: {redis_url}   Logs: {logs}")
                    echo("Press Ctrl-C to stop.")
                    waiting = []
            time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        return 0
    except CrashLoopError as e:
        echo(f"loraq up: {e}")
        echo("loraq up: stopping everything")
        return 1
    except UpError as e:
        echo(f"loraq up: {e}")
        return 1
    finally:
        # Ignore further signals while stopping so a second Ctrl-C cannot strand children.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        sup.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if stop_signal:
            echo("Stopped.")


def dependency_down(settings: Settings) -> str | None:
    """What the API and the workers need, checked when one of them exits: why Redis or the
    database does not answer, or None when both do (then the exit counts as a crash)."""
    from service.dependency import database_down, redis_down

    if why := redis_down(settings):
        return f"Redis does not answer: {why}"
    if why := database_down():
        return f"the database does not answer: {why}"
    return None


def _child(sup: Supervisor, name: str) -> Child:
    return next(c for c in sup.children if c.name == name)


def registered(settings: Settings, client: Redis, sup: Supervisor, name: str) -> bool:
    """Whether the running process of child `name` (the current one: a restart changes its pid)
    has registered: the worker's entry in the worker registry, the inference worker's heartbeat."""
    from service.inference import inference_worker_id, workers_key
    from service.worker_registry import list_workers

    pid, host = _child(sup, name).pid, socket.gethostname()
    try:
        if name == "inference":
            return client.zscore(workers_key(settings.inference_queue), inference_worker_id(pid)) is not None
        return any(w.get("pid") == pid and w.get("hostname") == host for w in list_workers(client))
    except REDIS_ERRORS:
        return False


def _release_jobs_of(worker_pid: int, echo: Callable[[str], None]) -> None:
    """The worker died holding a job: put it back now, so the restarted worker resumes it from
    its last checkpoint instead of waiting out the heartbeat timeout."""
    from service.reaper import release_jobs_of_worker

    result = release_jobs_of_worker(worker_pid)
    for job_id in result.requeued:
        echo(f"worker: job {job_id} re-queued; it resumes from its last checkpoint")
    for job_id in result.failed:
        echo(f"worker: job {job_id} failed: no attempts left")
    for job_id in result.cancelled:
        echo(f"worker: job {job_id} cancelled (its cancel was requested)")


def _reset_cached_settings() -> None:
    from service.settings import get_settings

    get_settings.cache_clear()
