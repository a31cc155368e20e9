"""API metrics: the request middleware (route templates, status codes, latency) and the
scrape-time state collector, with queue depth read from a real Redis after Celery publishes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from service import worker_registry
from service.api.metrics import StateSources, StoredCounts, install_metrics, kombu_queue_depth
from service.settings import get_settings
from tests.servers import shared_redis_url

STATUSES = ("queued", "running", "succeeded")
TOKEN = "scrape-token"
SCRAPE = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(autouse=True)
def metrics_bearer_token(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """/metrics wants a token: this one (unset, the API would make one in the data dir)."""
    monkeypatch.setenv("LORAQ_METRICS_BEARER_TOKEN", TOKEN)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def scrape(client: TestClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = client.get("/metrics", headers=SCRAPE).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def make_app(sources: StateSources) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/things/{thing_id}")
    def get_thing(thing_id: str) -> dict[str, str]:
        if thing_id == "missing":
            raise HTTPException(404, "no such thing")
        if thing_id == "boom":
            raise RuntimeError("unexpected")
        return {"id": thing_id}

    install_metrics(app, sources, STATUSES)
    return app


@pytest.fixture
def rds() -> redis.Redis:
    return redis.Redis.from_url(shared_redis_url())


def redis_sources(rds: redis.Redis, queue: str, jobs: dict[str, int]) -> StateSources:
    return StateSources(
        jobs_by_status=lambda: dict(jobs),
        stored=lambda: StoredCounts(files=3, file_bytes=1234, artifacts=2, artifact_bytes=5678),
        queue_depth=lambda: {queue: kombu_queue_depth(rds, queue)},
        unacked=lambda: int(rds.hlen("unacked")),
        workers_alive=lambda: len(worker_registry.worker_nodes(rds)),
    )


def test_requests_counted_by_route_template_and_status(rds: redis.Redis) -> None:
    app = make_app(redis_sources(rds, "q-unused", {}))
    with TestClient(app, raise_server_exceptions=False) as client:
        for thing in ("a", "b", "c"):
            assert client.get(f"/v1/things/{thing}").status_code == 200
        assert client.get("/v1/things/missing").status_code == 404
        assert client.get("/v1/things/boom").status_code == 500
        assert client.get("/nowhere/at/all").status_code == 404
        got = scrape(client)

    def n(route: str, status: str) -> float:
        labels = frozenset({("method", "GET"), ("route", route), ("status", status)})
        return got[("loraq_http_requests_total", labels)]

    assert n("/v1/things/{thing_id}", "200") == 3  # one series for three concrete paths
    assert n("/v1/things/{thing_id}", "404") == 1
    assert n("/v1/things/{thing_id}", "500") == 1
    assert n("<unmatched>", "404") == 1
    labels = frozenset({("method", "GET"), ("route", "/v1/things/{thing_id}"), ("status", "200")})
    assert got[("loraq_http_request_duration_seconds_count", labels)] == 3
    assert got[("loraq_http_request_duration_seconds_sum", labels)] > 0
    assert not any("/v1/things/a" in str(k) for k in got)


def test_state_collector_reads_queue_depth_from_redis(rds: redis.Redis) -> None:
    queue = f"metrics-test-{uuid.uuid4().hex[:8]}"
    sender = Celery("sender", broker=shared_redis_url())
    sender.conf.broker_connection_retry_on_startup = True
    jobs = {"queued": 2, "running": 1, "weird_status": 1}
    app = make_app(redis_sources(rds, queue, jobs))
    node = f"test-node-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(4):  # what the API does to enqueue a job: a real Kombu message
            sender.send_task("loraq.run_job", args=[f"ftjob-{i}"], queue=queue)
        sender.send_task("loraq.run_job", args=["ftjob-p"], queue=queue, priority=6)
        rds.set(worker_registry.worker_key(node), json.dumps({"node": node}), ex=30)
        rds.set(worker_registry.job_key(node), json.dumps({"job_id": "x"}), ex=30)
        with TestClient(app) as client:
            got = scrape(client)
    finally:
        keys = (worker_registry.worker_key(node), worker_registry.job_key(node))
        rds.delete(queue, f"{queue}\x06\x166", *keys)

    assert got[("loraq_queue_depth", frozenset({("queue", queue)}))] == 5
    assert got[("loraq_jobs", frozenset({("status", "queued")}))] == 2
    assert got[("loraq_jobs", frozenset({("status", "succeeded")}))] == 0  # known status, none yet
    assert got[("loraq_jobs", frozenset({("status", "weird_status")}))] == 1
    assert got[("loraq_files_stored", frozenset())] == 3
    assert got[("loraq_artifacts_stored_bytes", frozenset())] == 5678
    assert got[("loraq_workers_alive", frozenset())] >= 1  # ours (others' tests may add theirs)
    for source in ("database_jobs", "database_store", "redis_queue", "redis_workers"):
        assert got[("loraq_scrape_source_up", frozenset({("source", source)}))] == 1


def test_failing_source_is_reported_not_raised() -> None:
    dead = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    sources = redis_sources(dead, "q", {"queued": 1})
    app = make_app(sources)
    with TestClient(app) as client:
        resp = client.get("/metrics", headers=SCRAPE)
        assert resp.status_code == 200
        got = scrape(client)
    assert got[("loraq_scrape_source_up", frozenset({("source", "redis_queue")}))] == 0
    assert got[("loraq_scrape_source_up", frozenset({("source", "database_jobs")}))] == 1
    assert ("loraq_queue_depth", frozenset({("queue", "q")})) not in got
    assert got[("loraq_jobs", frozenset({("status", "queued")}))] == 1
