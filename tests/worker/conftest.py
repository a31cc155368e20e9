"""In-process worker tests: a migrated database (SQLite file and a fresh PostgreSQL database), a
data dir of the test's own, and helpers to make a tenant, upload a dataset and create a job."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import store_file
from tests.servers import create_pg_database, drop_pg_database


@dataclass
class WorkerEnv:
    url: str
    data_dir: Path
    tenant_id: str

    def upload(self, data: bytes, filename: str = "train.jsonl") -> str:
        return store_file(self.tenant_id, data, filename)

    def create_job(self, file_id: str, **spec: Any) -> str:
        from service import jobs
        from service.db.session import session_scope
        from service.schemas import JobCreate

        body = {
            "model": "tiny-llama",
            "training_file": file_id,
            "suffix": "t",
            "seed": 1,
            "hyperparameters": {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 5.0},
            "lora": {"r": 4, "alpha": 8},
            "max_seq_len": 128,
            "packing": False,  # one example per row: these tests count rows and steps
            **spec,
        }
        with session_scope() as s:
            return jobs.create_job(s, tenant_id=self.tenant_id, spec=JobCreate(**body)).id


@pytest.fixture(params=["sqlite", "postgresql"])
def worker_env(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[WorkerEnv]:
    from service.settings import get_settings

    pg_name = None
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'loraq.db'}"
    else:
        pg_name, url = create_pg_database("loraq_worker")
    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("LORAQ_DATABASE_URL", url)
    monkeypatch.setenv("LORAQ_CHECKPOINT_EVERY", "2")
    monkeypatch.setenv("LORAQ_HEARTBEAT_SECONDS", "0.2")
    get_settings.cache_clear()

    from service.auth import get_or_create_tenant
    from service.db.migrate import upgrade_head
    from service.db.session import dispose_engines, session_scope

    upgrade_head(url)
    with session_scope() as s:
        tenant_id = get_or_create_tenant(s, "worker-tests").id
    try:
        yield WorkerEnv(url=url, data_dir=tmp_path / "var", tenant_id=tenant_id)
    finally:
        dispose_engines()
        get_settings.cache_clear()
        if pg_name:
            drop_pg_database(pg_name)
