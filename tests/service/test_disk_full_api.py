"""The API on a full disk: `make up`'s layout (SQLite and the store under the data dir) on a real
16 MiB filesystem (tests/small_fs.py). An upload larger than the space left, and any write once
the disk is full, answer 507 `disk_full` in OpenAI's error body and leave nothing half-written;
reads go on answering; once space is freed, writes work again with nothing restarted."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.conftest import DATASET, ApiClient, job_body, make_tenant_key
from tests.servers import shared_redis_url
from tests.small_fs import SmallFs, small_fs


@pytest.fixture
def disk_api(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ApiClient, SmallFs]]:
    import redis
    from fastapi.testclient import TestClient

    from service.app import create_app
    from service.db.migrate import upgrade_head
    from service.db.session import dispose_engines
    from service.settings import get_settings

    queue = f"test-{secrets.token_hex(4)}"
    with small_fs(16) as fs:
        url = f"sqlite:///{fs.root / 'var' / 'loraq.db'}"
        (fs.root / "var").mkdir()
        monkeypatch.setenv("LORAQ_DATA_DIR", str(fs.root / "var"))
        monkeypatch.setenv("LORAQ_DATABASE_URL", url)
        monkeypatch.setenv("LORAQ_REDIS_URL", shared_redis_url())
        monkeypatch.setenv("LORAQ_WORKER_QUEUE", queue)
        monkeypatch.setenv("LORAQ_SECRET_KEY", secrets.token_hex(32))
        monkeypatch.setenv("LORAQ_REAPER_INTERVAL_SECONDS", "0")
        get_settings.cache_clear()
        upgrade_head(url)
        try:
            with TestClient(create_app(), raise_server_exceptions=False) as client:
                tenant_id, key = make_tenant_key()
                yield ApiClient(client, tenant_id, key), fs
        finally:
            dispose_engines()
            get_settings.cache_clear()
            r = redis.Redis.from_url(shared_redis_url())
            r.delete(queue)
            r.close()


def assert_disk_full(r: object, param: str | None) -> None:
    assert getattr(r, "status_code", None) == 507, getattr(r, "text", r)
    error = r.json()["error"]  # type: ignore[attr-defined]
    assert (error["type"], error["code"], error["param"]) == ("server_error", "disk_full", param), error
    assert "storage is full" in error["message"] and "retry once space has been freed" in error["message"]


def test_writes_on_a_full_disk_answer_507_and_reads_go_on(disk_api: tuple[ApiClient, SmallFs]) -> None:
    api, fs = disk_api
    file_id = api.upload(DATASET)
    job_id = api.create_job(file_id)["id"]

    # An upload larger than the space left: refused while streaming, its temp file removed at once.
    before, free = fs.files(), fs.free()
    big = b'{"messages": []}\n' * ((free + (1 << 20)) // 17)
    r = api.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("big.jsonl", big)})
    assert_disk_full(r, "file")
    assert fs.files() == before
    assert fs.free() >= free - (256 << 10)  # the space is back (the database may grow a little)

    fs.fill()
    r = api.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", DATASET)})
    assert_disk_full(r, "file")
    # A submit writes rows: SQLite says its disk is full. (Its WAL may hold a few rows still.)
    answers = [api.post("/v1/fine_tuning/jobs", json=job_body(file_id)) for _ in range(20)]
    assert {a.status_code for a in answers} <= {200, 507}, [a.text for a in answers if a.status_code != 200]
    assert_disk_full(answers[-1], None)
    for path in (f"/v1/fine_tuning/jobs/{job_id}", "/v1/files", f"/v1/files/{file_id}/content"):
        assert api.get(path).status_code == 200, path
    assert {f for f in fs.files() if ".part" in f or f.startswith("var/store/.")} == set()

    fs.unfill()
    assert api.upload(DATASET).startswith("file-")
    assert api.create_job(file_id)["status"] == "queued"
