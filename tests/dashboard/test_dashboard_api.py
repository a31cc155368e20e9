"""The dashboard's pages and /dashboard/api endpoints on a real database (SQLite and PostgreSQL)
with real API keys: auth, tenant isolation, progress, incremental metric rows, file summaries,
the worker registry in Redis, and the API's scrape-time metrics over the same database."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service import inference, storage, worker_registry
from service.api.metrics import metrics_token
from service.settings import get_settings
from tests.servers import create_pg_database, drop_pg_database, shared_redis_url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'loraq.db'}"
        return
    name, url = create_pg_database("loraq_dash")
    yield url
    from service.db.session import dispose_engines

    dispose_engines()
    drop_pg_database(name)


@pytest.fixture
def env(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Settings pointing at a fresh database; tables created; two tenants with a key each."""
    from service.auth import create_key
    from service.db.models import Base
    from service.db.session import get_engine, session_scope

    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("LORAQ_DATABASE_URL", db_url)
    monkeypatch.setenv("LORAQ_REDIS_URL", shared_redis_url())
    monkeypatch.setenv("LORAQ_WORKER_QUEUE", f"dash-{uuid.uuid4().hex[:8]}")
    get_settings.cache_clear()
    Base.metadata.create_all(get_engine(db_url))
    with session_scope() as s:
        keys = {"a": create_key(s, "tenant-a"), "b": create_key(s, "tenant-b")}
    yield {"keys": keys}
    get_settings.cache_clear()


def make_app() -> FastAPI:
    from service.api.dashboard import mount_dashboard
    from service.api.metrics import install_service_metrics
    from service.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)
    install_service_metrics(app, get_settings())
    mount_dashboard(app)
    return app


def add_job(tenant_name: str, *, status: str, steps: int, total: int | None = None) -> str:
    from sqlalchemy import select

    from service.db.models import Job, JobMetric, Tenant
    from service.db.session import session_scope

    with session_scope() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == tenant_name))
        assert tenant is not None
        job = Job(
            tenant_id=tenant.id, model="tiny-llama", training_file="file-x", hyperparameters={},
            lora={}, max_seq_len=64, seed=0, status=status, step=steps, total_steps=total or steps,
            train_loss=1.0 if steps else None, tokens_per_s=100.0, eta_seconds=3.0,
        )  # fmt: skip
        s.add(job)
        s.flush()
        for step in range(1, steps + 1):
            s.add(JobMetric(job_id=job.id, step=step, train_loss=5.0 / step, lr=1e-4, grad_norm=0.5,
                            tokens=64, tokens_per_s=100.0, step_seconds=0.1,
                            valid_loss=2.0 if step % 5 == 0 else None))  # fmt: skip
        return job.id


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_pages_and_assets_are_public_and_offline() -> None:
    with TestClient(make_app_without_db()) as c:
        for path in ("/", "/new", "/workers", "/jobs/ftjob-anything"):
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "/static/vendor/uplot/uPlot.iife.min.js" in r.text
            assert "http://" not in r.text and "https://" not in r.text  # nothing from elsewhere
            assert "{{" not in r.text
        uplot = ("vendor/uplot/uPlot.iife.min.js", "vendor/uplot/uPlot.min.css", "vendor/uplot/LICENSE.txt")
        for asset in (*uplot, "dashboard/common.js", "dashboard/job.js", "dashboard/app.css"):
            assert c.get(f"/static/{asset}").status_code == 200, asset
        assert c.get("/static/../api/dashboard.py").status_code == 404


def make_app_without_db() -> FastAPI:
    from service.api.dashboard import mount_dashboard

    app = FastAPI()
    mount_dashboard(app)
    return app


def test_data_needs_a_valid_key(env: dict[str, Any]) -> None:
    with TestClient(make_app()) as c:
        r = c.get("/dashboard/api/jobs")
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert c.get("/dashboard/api/jobs", headers=auth("sk-wrong-key-0123456789")).status_code == 401
        assert c.get("/dashboard/api/workers").status_code == 401


def test_jobs_progress_and_metrics(env: dict[str, Any]) -> None:
    done = add_job("tenant-a", status="succeeded", steps=12)
    running = add_job("tenant-a", status="running", steps=3, total=40)
    other = add_job("tenant-b", status="running", steps=2)
    key = env["keys"]["a"]
    with TestClient(make_app()) as c:
        body = c.get("/dashboard/api/jobs", headers=auth(key)).json()
        assert [j["id"] for j in body["data"]] == [running, done]  # newest first, own jobs only
        assert body["data"][0]["step"] == 3 and body["data"][0]["total_steps"] == 40
        filtered = c.get("/dashboard/api/jobs", params={"status": "succeeded"}, headers=auth(key)).json()
        assert [j["id"] for j in filtered["data"]] == [done]
        bad = c.get("/dashboard/api/jobs", params={"status": "sleeping"}, headers=auth(key))
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "status"

        rows = c.get(f"/dashboard/api/jobs/{done}/metrics", headers=auth(key)).json()["data"]
        assert [r["step"] for r in rows] == list(range(1, 13))
        assert rows[0]["train_loss"] == 5.0 and rows[4]["valid_loss"] == 2.0 and rows[3]["valid_loss"] is None
        later = c.get(f"/dashboard/api/jobs/{done}/metrics", params={"after": 10}, headers=auth(key)).json()
        assert [r["step"] for r in later["data"]] == [11, 12]

        # Another tenant's job is not found, whichever endpoint asks.
        for path in (f"/dashboard/api/jobs/{other}/metrics", f"/dashboard/api/jobs/{other}/progress"):
            r = c.get(path, headers=auth(key))
            assert r.status_code == 404 and r.json()["error"]["param"] == "job_id"

        # The API's /metrics counts every tenant's jobs by status, from the same database.
        text = c.get("/metrics", headers=auth(metrics_token(get_settings()))).text
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    assert got[("loraq_jobs", (("status", "running"),))] == 2
    assert got[("loraq_jobs", (("status", "succeeded"),))] == 1
    assert got[("loraq_jobs", (("status", "failed"),))] == 0
    assert got[("loraq_scrape_source_up", (("source", "database_jobs"),))] == 1
    route = ("route", "/dashboard/api/jobs/{job_id}/metrics")
    assert got[("loraq_http_requests_total", (("method", "GET"), route, ("status", "200")))] == 2
    assert got[("loraq_http_requests_total", (("method", "GET"), route, ("status", "404")))] == 1


def test_file_summary_reads_the_stored_file(env: dict[str, Any]) -> None:
    from sqlalchemy import select

    from service.db.models import File, Tenant
    from service.db.session import session_scope

    content = (
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n'
    )
    with session_scope() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == "tenant-a"))
        assert tenant is not None
        f = File(
            tenant_id=tenant.id,
            purpose="fine-tune",
            filename="d.jsonl",
            bytes=len(content),
            sha256=hashlib.sha256(content).hexdigest(),
            storage_key="",
        )  # fmt: skip (reads check it)
        s.add(f)
        s.flush()
        f.storage_key = storage.file_key(tenant.id, f.id)
        storage.put_bytes(f.storage_key, content)
        file_id = f.id
    with TestClient(make_app()) as c:
        body = c.get(f"/dashboard/api/files/{file_id}/summary", headers=auth(env["keys"]["a"])).json()
        assert body["examples"] == 1 and body["valid"] is False
        assert body["bad_lines"] == [{"line": 2, "reason": body["bad_lines"][0]["reason"]}]
        assert body["bad_lines"][0]["reason"].startswith("not valid JSON")
        other = c.get(f"/dashboard/api/files/{file_id}/summary", headers=auth(env["keys"]["b"]))
        assert other.status_code == 404 and other.json()["error"]["param"] == "file_id"


def test_workers_from_the_registry(env: dict[str, Any]) -> None:
    job_a = add_job("tenant-a", status="running", steps=2, total=10)
    rds = redis.Redis.from_url(shared_redis_url())
    node = f"host-{uuid.uuid4().hex[:6]}:123"
    entry = {"node": node, "queue": "q", "gpus": [], "kernels": {"compiled": False, "reason": "no CUDA"}}
    rds.set(worker_registry.worker_key(node), json.dumps(entry), ex=30)
    rds.set(worker_registry.job_key(node), json.dumps({"job_id": job_a, "step": 2}), ex=30)
    # a malformed entry (a worker of another version) is left out, not a 500 for the whole page
    bad = f"host-{uuid.uuid4().hex[:6]}:456"
    rds.set(worker_registry.worker_key(bad), json.dumps({"node": bad, "gpus": "not a list"}), ex=30)
    # inference workers by their heartbeats: a live one is listed, one silent past
    # WORKER_ALIVE_SECONDS (it died without leaving the set) is not
    chat_queue = f"chat-{uuid.uuid4().hex[:6]}"
    live, dead = f"chathost-{uuid.uuid4().hex[:6]}:789", f"chathost-{uuid.uuid4().hex[:6]}:790"
    beat = time.time()
    rds.zadd(inference.workers_key(chat_queue), {live: beat, dead: beat - inference.WORKER_ALIVE_SECONDS - 5})
    try:
        with TestClient(make_app()) as c:
            page_a = c.get("/dashboard/api/workers", headers=auth(env["keys"]["a"])).json()
            seen_by_a = page_a["data"]
            seen_by_b = c.get("/dashboard/api/workers", headers=auth(env["keys"]["b"])).json()["data"]
    finally:
        rds.delete(
            worker_registry.worker_key(node), worker_registry.job_key(node), worker_registry.worker_key(bad),
            inference.workers_key(chat_queue),
        )  # fmt: skip
    assert page_a["object"] == "list"
    assert not [w for w in seen_by_a if w["node"] == bad]
    training = {**entry, "kind": "training"}
    assert [w for w in seen_by_a if w["node"] == node] == [{**training, "job": {"job_id": job_a, "step": 2}}]
    # Workers are shared; another tenant sees the worker busy, not which job it runs.
    assert [w for w in seen_by_b if w["node"] == node] == [
        {**training, "job": {"job_id": None, "other_tenant": True}}
    ]
    # after the training workers, the inference worker with what its heartbeat tells
    chat = [w for w in seen_by_a if w.get("queue") == chat_queue]
    assert chat == [{"node": live, "kind": "inference", "hostname": live.split(":")[0], "pid": 789,
                     "queue": chat_queue, "last_seen": pytest.approx(beat)}]  # fmt: skip
    assert seen_by_a.index(chat[0]) > seen_by_a.index(next(w for w in seen_by_a if w["node"] == node))


def test_openapi_documents_typed_bodies_and_error_bodies() -> None:
    """Every JSON endpoint of the dashboard names its response model, and its 400/401/404 bodies
    are OpenAI's error body, as the /v1 routes document them."""
    spec = make_app_without_db().openapi()
    operations = {
        path: ops["get"] for path, ops in spec["paths"].items() if path.startswith("/dashboard/api/")
    }
    assert len(operations) == 8
    error_body = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, op in operations.items():
        for status in ("400", "401", "404"):
            assert op["responses"][status]["content"]["application/json"]["schema"] == error_body, path
        if path.endswith(".csv"):
            assert "text/csv" in op["responses"]["200"]["content"]
            continue
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].startswith("#/components/schemas/"), (path, ok)
    # the chart rows are the stored steps' schema, the one the results CSV is written from
    rows = spec["components"]["schemas"]["StepRowsPublic"]["properties"]["data"]["items"]
    assert rows == {"$ref": "#/components/schemas/StepRow"}
