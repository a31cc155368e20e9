"""Shared fixtures for control-plane tests.

- `db_url`: a migrated database, parametrised over SQLite (a file) and PostgreSQL (a database
  `loraq_test_<worker>_<random>` created for this test session on the suite's server, dropped after).
  tests/servers.py says which servers: given by `LORAQ_TEST_*_URL`, or throwaway ones.
  Both live for the session; tests isolate themselves by creating their own tenants.
- `loraq_env`: Settings pointing at `db_url`, a data dir of the test's own, the suite's Redis and a
  queue name of the test's own (its messages are deleted after the test).
- `api`: a TestClient over `create_app()` with a fresh tenant and its key; `api.other` is a second
  tenant's client (isolation tests). Factories: `make_tenant`, `upload_file`, `create_job`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import parallel
from tests.parallel import (  # noqa: F401  (hooks: how the suite runs on xdist workers)
    pytest_collection_modifyitems,
    pytest_runtest_protocol,
    pytest_xdist_make_scheduler,
)
from tests.servers import create_pg_database, drop_pg_database, shared_redis_url, stop_throwaway_servers

__all__ = ["create_pg_database", "drop_pg_database"]
pytest_plugins = ("tests.cpu_times",)  # `--cpu-times PATH`: each test's CPU seconds (tests/cpu_times.py)


def pytest_configure(config: pytest.Config) -> None:
    """The processes the suite starts (API, workers, `loraq up`) often train side by side on a
    2-core machine. With torch's default of one OpenMP thread per core they oversubscribe it, and
    a thread that loses its core stalls its siblings at every parallel region: a small fwd/bwd
    loop took 2.8 s instead of 1.25 s with one thread while another process kept one core busy.
    So children get one thread each; this process keeps every core for the in-process tests, or
    its share of them when xdist workers run side by side (tests/parallel.py)."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.worker_count(config)))


def pytest_unconfigure(config: pytest.Config) -> None:
    with parallel.beside_other_tests(config):
        stop_throwaway_servers()


@pytest.fixture(scope="session")
def _sqlite_db(tmp_path_factory: pytest.TempPathFactory) -> str:
    from service.db.migrate import upgrade_head

    url = f"sqlite:///{tmp_path_factory.mktemp('db') / 'loraq.db'}"
    upgrade_head(url)
    return url


@pytest.fixture(scope="session")
def _postgres_db() -> Iterator[str]:
    from service.db.migrate import upgrade_head
    from service.db.session import dispose_engines

    name, url = create_pg_database()
    try:
        upgrade_head(url)
        yield url
    finally:
        dispose_engines()
        drop_pg_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    fixture = "_sqlite_db" if request.param == "sqlite" else "_postgres_db"
    url: str = request.getfixturevalue(fixture)
    return url


@dataclass
class LoraqEnv:
    db_url: str
    data_dir: Path
    queue: str

    @property
    def store_root(self) -> Path:
        return self.data_dir / "store"


@pytest.fixture
def loraq_env(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoraqEnv]:
    import redis

    from service.settings import get_settings

    env = LoraqEnv(db_url=db_url, data_dir=tmp_path / "var", queue=f"test-{secrets.token_hex(4)}")
    monkeypatch.setenv("LORAQ_DATA_DIR", str(env.data_dir))
    monkeypatch.setenv("LORAQ_DATABASE_URL", db_url)
    monkeypatch.setenv("LORAQ_REDIS_URL", shared_redis_url())
    monkeypatch.setenv("LORAQ_WORKER_QUEUE", env.queue)
    monkeypatch.setenv("LORAQ_SECRET_KEY", secrets.token_hex(32))
    # No reaper loop in API tests: the databases are shared by the session, and a tick would
    # re-queue or re-send other tests' jobs. tests/service/test_reaper.py runs it on its own.
    monkeypatch.setenv("LORAQ_REAPER_INTERVAL_SECONDS", "0")
    # Nor the webhook sender: tests/service/test_webhook_delivery.py turns it on for its own endpoints.
    monkeypatch.setenv("LORAQ_WEBHOOK_INTERVAL_SECONDS", "0")
    get_settings.cache_clear()
    yield env
    get_settings.cache_clear()
    r = redis.Redis.from_url(shared_redis_url())
    r.delete(env.queue)  # messages a test enqueued must not reach another helper's worker
    r.close()


def make_tenant_key(name: str | None = None) -> tuple[str, str]:
    """(tenant id, plaintext key) of a new tenant."""
    from sqlalchemy import select

    from service.auth import create_key
    from service.db.models import Tenant
    from service.db.session import session_scope

    name = name or f"tenant-{secrets.token_hex(4)}"
    with session_scope() as s:
        key = create_key(s, name)
        tenant_id = s.scalar(select(Tenant.id).where(Tenant.name == name))
    assert tenant_id is not None
    return tenant_id, key


@dataclass
class ApiClient:
    """A TestClient bound to one tenant's key."""

    client: Any
    tenant_id: str
    key: str
    other: ApiClient | None = field(default=None, repr=False)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def request(self, method: str, path: str, **kw: Any) -> Any:
        headers = {**self.headers, **kw.pop("headers", {})}
        return self.client.request(method, path, headers=headers, **kw)

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw: Any) -> Any:
        return self.request("POST", path, **kw)

    def delete(self, path: str, **kw: Any) -> Any:
        return self.request("DELETE", path, **kw)

    def scrape_metrics(self) -> str:
        """GET /metrics with its bearer token (service/api/metrics.py)."""
        from service.api.metrics import metrics_token
        from service.settings import get_settings

        token = metrics_token(get_settings())
        r = self.client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
        return str(r.text)

    def upload(self, data: bytes, filename: str = "train.jsonl", purpose: str = "fine-tune") -> str:
        r = self.post("/v1/files", data={"purpose": purpose}, files={"file": (filename, data)})
        assert r.status_code == 200, r.text
        return str(r.json()["id"])

    def create_job(self, file_id: str, **spec: Any) -> dict[str, Any]:
        r = self.post("/v1/fine_tuning/jobs", json=job_body(file_id, **spec))
        assert r.status_code == 200, r.text
        job: dict[str, Any] = r.json()
        return job


def store_file(tenant_id: str, data: bytes, filename: str = "train.jsonl", purpose: str = "fine-tune") -> str:
    """A file row plus its bytes in the store, as POST /v1/files leaves them (without its
    validation, so a test can store a bad dataset); its id."""
    from service import files
    from service.db.session import session_scope

    with session_scope() as s:
        return files.create_file_from_bytes(
            s, tenant_id=tenant_id, filename=filename, purpose=purpose, content=data
        ).id


def job_body(file_id: str, **spec: Any) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "training_file": file_id,
        "suffix": "t",
        "seed": 1,
        "hyperparameters": {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 2.0},
        "lora": {"r": 4, "alpha": 8},
        "max_seq_len": 64,
        **spec,
    }


DATASET = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "arr"}]}\n' * 4


@pytest.fixture
def api(loraq_env: LoraqEnv) -> Iterator[ApiClient]:
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(), raise_server_exceptions=False) as client:
        a_id, a_key = make_tenant_key()
        b_id, b_key = make_tenant_key()
        other = ApiClient(client, b_id, b_key)
        yield ApiClient(client, a_id, a_key, other=other)
