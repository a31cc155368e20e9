"""The servers the suite talks to, in one place: every Redis and PostgreSQL URL of tests/ comes
from here, and every external binary is found here.

- `LORAQ_TEST_REDIS_URL` / `LORAQ_TEST_DATABASE_URL` point the suite at existing servers (the
  database URL names a PostgreSQL server and a database on it that the suite may connect to as a
  user allowed to `CREATE DATABASE`; each test database is made next to it and dropped after).
- Without them, the first test that needs one starts a throwaway server: `redis-server` on a free
  loopback port, or an `initdb` cluster in a temp dir (fsync off, trust auth, its unix socket in
  that dir) run by `postgres` on a free port. `stop_throwaway_servers()` (the root conftest's
  `pytest_unconfigure`) stops them; they also die with the pytest process (PR_SET_PDEATHSIG).
- S3: `start_s3` runs moto's standalone server (`python -m moto.server`, from the dev extra) on a
  free loopback port; `shared_s3()` is the session's, and each test makes a bucket of its own.
- MLflow: `start_mlflow` runs `mlflow server` (dev extra) on a free loopback port, its runs in a
  SQLite file of the test's own.
- `require_binary` fails a test whose binary is missing, naming the Debian package: a missing
  server is never a silent skip.

initdb and postgres refuse to run as root, and CI runs the suite as root: as root the cluster is
owned and run by the `postgres` user (or `nobody` where that user does not exist).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import pytest

from service.supervisor import die_with_parent, free_port

# binary -> Debian package that ships it; README.md's one line lists the same packages.
PACKAGES = {
    "redis-server": "redis-server",
    "initdb": "postgresql",
    "postgres": "postgresql",
    "chromium": "chromium",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "ip": "iproute2",  # tests/netns.py: a worker "host" in a network namespace of its own
    "socat": "socat",
}
POSTGRES_BIN_GLOB = "/usr/lib/postgresql/*/bin"


def find_binary(name: str) -> str | None:
    """`name` on PATH, or (PostgreSQL's server binaries) in Debian's versioned bin directory."""
    found = shutil.which(name)
    if found is None and name in {"initdb", "postgres", "pg_ctl"}:
        dirs = sorted(Path("/").glob(POSTGRES_BIN_GLOB.lstrip("/")), key=_pg_version, reverse=True)
        found = next((str(d / name) for d in dirs if (d / name).exists()), None)
    return found


def _pg_version(bin_dir: Path) -> int:
    version = bin_dir.parent.name
    return int(version) if version.isdigit() else 0


def require_binary(name: str) -> str:
    """Path of `name`; fails the calling test (never skips) naming the package to install."""
    found = find_binary(name)
    if found is None:
        package = PACKAGES.get(name, name)
        pytest.fail(f"`{name}` is not installed: apt-get install -y {package}", pytrace=False)
    return found


def wait_until(check: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        if check():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} was not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
    """Signal the process group, wait up to `grace` seconds, then kill what remains."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# --------------------------------------------------------------------------- Redis
@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop(self.proc, sig)

    def stall(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open and nothing answers, as with a
        stalled disk or a paused VM."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def unstall(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def stallable_redis(workdir: Path) -> Iterator[RedisServer]:
    """A test's own `redis-server` (the test stalls it), resumed and stopped however the test ends."""
    server = start_redis(workdir)
    try:
        yield server
    finally:
        server.unstall()
        server.stop()


def api_ready(url: str) -> bool:
    """Whether the Loraq API at `url` (no /v1) answers /readyz with 200."""
    import httpx

    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:  # not listening yet, or restarting
        return False


def redis_answers(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.exceptions.ConnectionError:
        return False
    finally:
        client.close()


def start_redis(workdir: Path, *, port: int | None = None, appendonly: bool = False) -> RedisServer:
    """A `redis-server` on loopback (a free port unless `port`), its files in `workdir`."""
    binary = require_binary("redis-server")
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--dir", str(workdir)]  # fmt: skip
    proc = subprocess.Popen(
        argv,
        stdout=(workdir / "redis.log").open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    server = RedisServer(proc, port)
    wait_until(lambda: redis_answers(server.url), "redis-server", proc, timeout=20)
    return server


# --------------------------------------------------------------------------- PostgreSQL
def _cluster_user() -> pwd.struct_passwd | None:
    """Who runs the throwaway cluster: this process unless it is root (initdb refuses root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root, and neither a `postgres` nor a `nobody` user exists to run initdb")


class AsUser(TypedDict, total=False):
    """The keyword arguments of subprocess.run/Popen that run the cluster as `_cluster_user()`."""

    user: int
    group: int
    extra_groups: list[int]
    cwd: Path


@dataclass
class PostgresServer:
    proc: subprocess.Popen[bytes]
    port: int
    root: Path
    as_user: AsUser

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def halt(self) -> None:
        """Stop the server (fast shutdown: sessions are ended), keeping its data for `resume()`."""
        stop(self.proc, signal.SIGINT)  # SIGINT: PostgreSQL's fast shutdown

    def resume(self) -> None:
        """Serve the cluster again, on the same port, after `halt()`."""
        self.proc = _serve_cluster(self.root, self.port, self.as_user)
        wait_until(lambda: _pg_answers(self.admin_url), "postgres", self.proc, timeout=60)

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """An initdb cluster in a new temp dir, served on a free loopback port until `stop()`."""
    initdb = require_binary("initdb")
    user = _cluster_user()
    # /tmp, not a per-user TMPDIR: the cluster's user must be able to reach the directory.
    root = Path(tempfile.mkdtemp(prefix="loraq-test-pg-", dir="/tmp" if user else None))
    as_user: AsUser = {}
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": [], "cwd": root}
    subprocess.run(
        [initdb, "-D", str(root / "data"), "-U", "postgres", "--auth=trust", "-E", "UTF8",
         "--locale=C", "--no-sync"],
        stdout=(root / "postgres.log").open("ab"), stderr=subprocess.STDOUT, check=True, **as_user,
    )  # fmt: skip
    port = free_port()
    server = PostgresServer(_serve_cluster(root, port, as_user), port, root, as_user)
    wait_until(lambda: _pg_answers(server.admin_url), "postgres", server.proc, timeout=60)
    return server


def _serve_cluster(root: Path, port: int, as_user: AsUser) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [require_binary("postgres"), "-D", str(root / "data"), "-p", str(port), "-h", "127.0.0.1",
         "-k", str(root),
         # a throwaway cluster: durability buys nothing, speed does
         "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
         "-c", "max_connections=300"],
        stdout=(root / "postgres.log").open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=die_with_parent(), **as_user,
    )  # fmt: skip


def _pg_answers(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=1).close()
        return True
    except psycopg.OperationalError:
        return False


# --------------------------------------------------------------------------- S3 (moto's server)
# Parts of a multipart upload may be this small on the test server (S3's own floor is 5 MiB), so
# a test's small objects still go up in several parts.
S3_MIN_PART_BYTES = 64 * 1024
S3_ACCESS = {"AWS_ACCESS_KEY_ID": "loraq-test", "AWS_SECRET_ACCESS_KEY": "loraq-test-secret"}


@dataclass
class S3Server:
    """moto's standalone S3-compatible server (`python -m moto.server`), objects in its memory."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=S3_ACCESS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=S3_ACCESS["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}),
        )  # fmt: skip

    def new_bucket(self) -> str:
        """A new empty bucket of the caller's own (`loraq-<xdist worker>-<random>`)."""
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        name = f"loraq-{worker}-{secrets.token_hex(4)}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self, bucket: str, prefix: str = "loraq") -> dict[str, str]:
        """The settings that point a Loraq process at `s3://bucket/prefix` on this server."""
        return {
            "LORAQ_STORAGE_URL": f"s3://{bucket}/{prefix}",
            "LORAQ_S3_ENDPOINT_URL": self.endpoint,
            "LORAQ_S3_REGION": "us-east-1",
            "LORAQ_S3_ACCESS_KEY_ID": S3_ACCESS["AWS_ACCESS_KEY_ID"],
            "LORAQ_S3_SECRET_ACCESS_KEY": S3_ACCESS["AWS_SECRET_ACCESS_KEY"],
            "LORAQ_S3_ADDRESSING_STYLE": "path",
            "LORAQ_STORAGE_PART_BYTES": str(S3_MIN_PART_BYTES),
        }

    def stop(self) -> None:
        stop(self.proc)


def _s3_answers(endpoint: str) -> bool:
    import httpx

    try:
        return httpx.get(endpoint + "/moto-api/", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start_s3(workdir: Path) -> S3Server:
    """moto's S3 server on a free loopback port, its log in `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, **S3_ACCESS, "S3_UPLOAD_PART_MIN_SIZE": str(S3_MIN_PART_BYTES)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env, stdout=(workdir / "moto.log").open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=die_with_parent(),
    )  # fmt: skip
    server = S3Server(proc, port)
    wait_until(lambda: _s3_answers(server.endpoint), "moto S3 server", proc, timeout=60)
    return server


# --------------------------------------------------------------------------- MLflow tracking server
@dataclass
class MlflowServer:
    """`mlflow server` (the dev extra's full mlflow) with a SQLite backend store in its workdir."""

    proc: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop(self.proc)


def _mlflow_answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def start_mlflow(workdir: Path) -> MlflowServer:
    """A tracking server on a free loopback port: runs in `workdir`/mlflow.db, artifacts beside."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
         "--artifacts-destination", str(workdir / "artifacts")],
        cwd=workdir, stdout=(workdir / "mlflow.log").open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=die_with_parent(),
    )  # fmt: skip
    server = MlflowServer(proc, port)
    wait_until(lambda: _mlflow_answers(server.url), "mlflow server", proc, timeout=120)
    return server


# --------------------------------------------------------------------------- the session's servers
_throwaway: dict[str, RedisServer | PostgresServer | S3Server] = {}


def shared_s3() -> S3Server:
    """The session's S3 server (moto's, started on first use); each test makes its own bucket."""
    if "s3" not in _throwaway:
        _throwaway["s3"] = start_s3(Path(tempfile.mkdtemp(prefix="loraq-test-s3-")))
    server = _throwaway["s3"]
    assert isinstance(server, S3Server)
    return server


def shared_redis_url() -> str:
    """The session's Redis: `LORAQ_TEST_REDIS_URL`, else a throwaway server started on first use."""
    if url := os.environ.get("LORAQ_TEST_REDIS_URL"):
        return url
    if "redis" not in _throwaway:
        _throwaway["redis"] = start_redis(Path(tempfile.mkdtemp(prefix="loraq-test-redis-")))
    server = _throwaway["redis"]
    assert isinstance(server, RedisServer)
    return server.url


def pg_admin_url() -> str:
    """A libpq URL on the session's PostgreSQL from which the suite creates and drops databases."""
    if url := os.environ.get("LORAQ_TEST_DATABASE_URL"):
        return url.replace("postgresql+psycopg://", "postgresql://", 1)
    if "postgres" not in _throwaway:
        _throwaway["postgres"] = start_postgres()
    server = _throwaway["postgres"]
    assert isinstance(server, PostgresServer)
    return server.admin_url


def pg_url(name: str) -> str:
    """The SQLAlchemy URL of database `name` on the session's PostgreSQL."""
    from sqlalchemy.engine import make_url

    url = make_url(pg_admin_url()).set(drivername="postgresql+psycopg", database=name)
    return url.render_as_string(hide_password=False)


def create_pg_database(prefix: str = "loraq_test") -> tuple[str, str]:
    """(name, SQLAlchemy URL) of a new empty database `<prefix>_<xdist worker>_<random>` (the worker,
    gw0, gw1, ... or `main`, says whose it is on a server that several workers share)."""
    import psycopg

    name = f"{prefix}_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}_{secrets.token_hex(4)}"
    with psycopg.connect(pg_admin_url(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, pg_url(name)


def drop_pg_database(name: str) -> None:
    import psycopg

    with psycopg.connect(pg_admin_url(), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def stop_throwaway_servers() -> None:
    while _throwaway:
        _, server = _throwaway.popitem()
        server.stop()
