"""`loraq up`: the whole service on one machine, in the foreground.

Starts, in order: a private `redis-server` (only when `LORAQ_REDIS_URL` is unset), database
migrations, the API key, the API (uvicorn) and one Celery worker. Every child runs in its own
process group (`start_new_session`), so a terminal's Ctrl-C reaches only this supervisor, which
then stops the children in reverse order and kills whatever a group still holds after a grace
period. The children's PIDs are written to `<data_dir>/up.pids.json` while they run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.settings import Settings

GRACE_SECONDS = 15.0
READY_TIMEOUT_SECONDS = 120.0
PID_FILE = "up.pids.json"


class UpError(RuntimeError):
    """`loraq up` could not start; the message says which part and why."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Supervisor:
    """Owns the child processes; `stop()` is idempotent and safe from a signal handler."""

    children: list[Child] = field(default_factory=list)
    pid_file: Path | None = None
    grace: float = GRACE_SECONDS
    _stopping: threading.Event = field(default_factory=threading.Event)

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str], log_path: Path | None) -> Child:
        out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
        )
        child = Child(name, proc)
        self.children.append(child)
        self._write_pids()
        return child

    def _write_pids(self) -> None:
        if self.pid_file is None:
            return
        pids = {c.name: c.pid for c in self.children}
        self.pid_file.write_text(json.dumps({"supervisor": os.getpid(), **pids}))

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        # Reverse start order: API and worker first, Redis last (the worker acks into it).
        for child in reversed(self.children):
            _terminate_group(child, self.grace)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)


def _terminate_group(child: Child, grace: float) -> None:
    """SIGTERM the child's process group, then SIGKILL what is left after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.proc.wait(timeout=grace)
    # The group may hold grandchildren (uvicorn reloader, celery pool) even after the leader exits.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_redis(sup: Supervisor, data_dir: Path, env: dict[str, str]) -> str:
    """Start a private redis-server on a free loopback port; return its URL once it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise UpError(
            "LORAQ_REDIS_URL is unset and no `redis-server` binary is on PATH: "
            "install Redis (apt-get install redis-server) or set LORAQ_REDIS_URL"
        )
    redis_dir = data_dir / "redis"
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
    _wait_until(lambda: _redis_ping(url), child, "redis-server", timeout=20.0)
    return url


def _redis_ping(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=0.5).ping())
    except redis.exceptions.ConnectionError:
        return False


def _wait_until(ready: Callable[[], bool], child: Child, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            raise UpError(f"{what} exited with code {child.proc.returncode} while starting; see its log")
        if ready():
            return
        time.sleep(0.1)
    raise UpError(f"{what} was not ready after {timeout:.0f}s")


def _http_ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def prepare_database_and_key(settings: Settings) -> tuple[str, bool]:
    """Run migrations and make sure an API key works; return (key, generated)."""
    from service.auth import create_key, ensure_bootstrap_key
    from service.db.migrate import upgrade_head
    from service.db.session import session_scope

    upgrade_head(settings.resolved_database_url)
    with session_scope() as session:
        if settings.api_key:
            ensure_bootstrap_key(session, settings.api_key)
            return settings.api_key, False
        return create_key(session, "default"), True


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
    return [
        sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
        "--host", settings.host, "--port", str(settings.port),
        "--workers", str(settings.api_workers),
        "--no-access-log", "--timeout-graceful-shutdown", "5",
    ]  # fmt: skip


def worker_argv(settings: Settings) -> list[str]:
    return [sys.executable, "-m", "service.cli", "worker", "--queue", settings.worker_queue]


def run_up(settings: Settings, echo: Callable[[str], None] = print) -> int:
    """Start everything, block until a signal or a child's exit, stop everything. Returns exit code."""
    data_dir = settings.resolved_data_dir
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(pid_file=data_dir / PID_FILE)
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)
        raise KeyboardInterrupt  # unwinds whatever step `run_up` is in, straight to `finally`

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = dict(os.environ)
        redis_url = settings.redis_url or start_redis(sup, data_dir, env)
        settings = settings.model_copy(update={"redis_url": redis_url})
        env = child_env(settings, redis_url)
        # Children and this process's DB helpers read the same settings from the environment.
        os.environ.update({k: env[k] for k in ("LORAQ_DATA_DIR", "LORAQ_DATABASE_URL", "LORAQ_REDIS_URL")})
        _reset_cached_settings()

        key, generated = prepare_database_and_key(settings)
        env["LORAQ_API_KEY"] = key

        api = sup.spawn("api", api_argv(settings), env=env, log_path=logs / "api.log")
        sup.spawn("worker", worker_argv(settings), env=env, log_path=logs / "worker.log")
        base = f"http://{settings.host}:{settings.port}"
        _wait_until(lambda: _http_ready(f"{base}/readyz"), api, "the API", timeout=READY_TIMEOUT_SECONDS)

        echo(f"Loraq is up: {base}  (OpenAI base_url {base}/v1, docs {base}/docs)")
        echo(f"API key{' (generated for tenant default)' if generated else ''}: {key}")
        echo(f"Data: {data_dir}   Redis: {redis_url}   Logs: {logs}")
        echo("Press Ctrl-C to stop.")
        while (dead := sup.first_exited()) is None:
            time.sleep(0.5)
        echo(f"{dead.name} exited with code {dead.proc.returncode}; stopping (see {logs})")
        return 1
    except KeyboardInterrupt:
        return 0
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


def _reset_cached_settings() -> None:
    from service.settings import get_settings

    get_settings.cache_clear()
