"""The database stopped under a running API: a real PostgreSQL cluster of this module's own,
stopped (fast shutdown, its sessions ended) and started again on the same port.

While it is down every route that needs it answers 503 `database_unavailable` with `Retry-After`,
except a status poll of a job that the same key read before, which gets that body again marked
stale (`Age`, `Loraq-Stale`). Once it is back, everything answers as before, with nothing
restarted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from service.api.last_served import STALE_HEADER
from service.errors import DATABASE_RETRY_AFTER_S
from tests.conftest import DATASET, ApiClient, job_body
from tests.servers import PostgresServer, start_postgres

# Routes that answer without the database: liveness, and readiness (503 with its own body).
NO_DATABASE = {"/healthz", "/readyz"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[PostgresServer]:
    server = start_postgres()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def db_url(cluster: PostgresServer) -> Iterator[str]:
    """Overrides the suite's `db_url`: `loraq_env` and `api` run on this module's cluster."""
    import psycopg

    from service.db.migrate import upgrade_head
    from service.db.session import dispose_engines

    with psycopg.connect(cluster.admin_url, autocommit=True) as conn:
        conn.execute('CREATE DATABASE "outage"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:{cluster.port}/outage"
    upgrade_head(url)
    try:
        yield url
    finally:
        dispose_engines()
        with psycopg.connect(cluster.admin_url, autocommit=True) as conn:
            conn.execute('DROP DATABASE IF EXISTS "outage" WITH (FORCE)')


def every_request(api: ApiClient, ids: dict[str, str]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(method, URL, request arguments) of every operation in the OpenAPI schema but
    `NO_DATABASE`, with real ids and a valid body: a route added later is covered, and one with a
    path parameter not in `ids` fails the test."""
    bodies: dict[tuple[str, str], dict[str, Any]] = {
        ("post", "/v1/files"): {"data": {"purpose": "fine-tune"}, "files": {"file": ("t.jsonl", DATASET)}},
        ("post", "/v1/fine_tuning/jobs"): {"json": job_body(ids["file_id"])},
        ("post", "/v1/webhook_endpoints"): {"json": {"url": "https://93.184.215.14/hook"}},
        ("post", "/v1/chat/completions"): {
            "json": {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
        },
    }
    for path, operations in api.client.app.openapi()["paths"].items():
        if path in NO_DATABASE:
            continue
        for method in operations:
            yield method.upper(), path.format(**ids), bodies.get((method, path), {})


def test_the_schema_documents_503_where_the_database_is_read_and_507_where_a_write_may_fill_a_disk() -> None:
    from service.app import create_app

    writes = {("post", "/v1/files"), ("delete", "/v1/files/{file_id}"), ("post", "/v1/fine_tuning/jobs")}
    writes |= {
        ("post", f"/v1/fine_tuning/jobs/{{fine_tuning_job_id}}/{a}") for a in ("cancel", "pause", "resume")
    }
    writes |= {("post", "/v1/webhook_endpoints"), ("delete", "/v1/webhook_endpoints/{endpoint_id}")}
    for path, operations in create_app().openapi()["paths"].items():
        for method, operation in operations.items():
            documented = operation["responses"].keys()
            assert path in NO_DATABASE or "503" in documented, (method, path)
            assert ("507" in documented) == ((method, path) in writes), (method, path)


def test_database_stopped_answers_503_and_recent_status_reads_stale(
    api: ApiClient, cluster: PostgresServer
) -> None:
    file_id = api.upload(DATASET)
    job = api.create_job(file_id)
    polled = api.get(f"/v1/fine_tuning/jobs/{job['id']}")
    assert polled.status_code == 200 and STALE_HEADER not in polled.headers
    unpolled = api.create_job(file_id)["id"]  # created, never read by a status poll
    ids = {
        "file_id": file_id,
        "fine_tuning_job_id": unpolled,
        "job_id": unpolled,
        "checkpoint_id": "ftckpt-000000000000000000000000",
        "endpoint_id": "whep-000000000000000000000000",
        "model": "tiny-llama",
    }

    cluster.halt()
    try:
        # The job this key polled: its last body again, marked stale, however many times.
        for _ in range(2):
            r = api.get(f"/v1/fine_tuning/jobs/{job['id']}")
            assert r.status_code == 200, r.text
            assert r.content == polled.content
            assert r.headers[STALE_HEADER] == "database-unavailable"
            assert 0 <= int(r.headers["Age"]) < 60
        # Every other request that needs the database, including the same poll by another key.
        requests = [*every_request(api, ids), ("GET", f"/v1/fine_tuning/jobs/{job['id']}", {})]
        assert len(requests) > 20
        for i, (method, url, kwargs) in enumerate(requests):
            client = api.other if i == len(requests) - 1 else api
            assert client is not None
            r = client.request(method, url, **kwargs)
            assert r.status_code == 503, (method, url, r.status_code, r.text)
            assert r.headers["Retry-After"] == str(DATABASE_RETRY_AFTER_S), (method, url)
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("server_error", "database_unavailable"), (method, url)
            assert STALE_HEADER not in r.headers
        ready = api.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["checks"]["database"] != "ok"
        assert api.client.get("/healthz").status_code == 200
    finally:
        cluster.resume()

    # Back: nothing restarted, fresh answers.
    r = api.get(f"/v1/fine_tuning/jobs/{job['id']}")
    assert r.status_code == 200 and STALE_HEADER not in r.headers, r.text
    assert json.loads(r.content)["status"] == job["status"]
    assert api.get("/v1/files").status_code == 200
    assert api.create_job(file_id)["status"] == "queued"
    assert api.client.get("/readyz").status_code == 200
