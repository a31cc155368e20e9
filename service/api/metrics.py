"""The API's Prometheus endpoint, `GET /metrics`, behind a bearer token: `metrics_bearer_token`,
else one generated once in `<data_dir>/metrics_token` (owner-only; `metrics_token`). Prometheus
sends it (`authorization: {credentials_file: ...}`, docker/prometheus.yml).

Two kinds of series:
- per request, from `RequestMetricsMiddleware`: `loraq_http_requests_total` and
  `loraq_http_request_duration_seconds`, labelled by method, route *template* (`/v1/fine_tuning/
  jobs/{job_id}`, never the concrete path, so the label set stays bounded) and status code;
- service state, read at scrape time by `ServiceStateCollector`: jobs by status and files and
  artifacts stored (database), queue depth and unacknowledged messages (Redis), workers alive
  (the worker registry in Redis). A source that fails is skipped and
  `loraq_scrape_source_up{source}` says so; the scrape itself never fails.

Every app gets its own `CollectorRegistry` (tests build many apps in one process).
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.broker import KOMBU_UNACKED_KEY, kombu_queue_depth
from service.errors import AuthenticationError
from service.job_status import JOB_STATUSES
from service.redis_client import redis_client
from service.secret_files import read_or_create
from service.settings import Settings, get_settings
from service.supervisor import RESTARTS_FILE

log = logging.getLogger("loraq.api.metrics")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
UNMATCHED_ROUTE = "<unmatched>"
METRICS_TOKEN_FILE = "metrics_token"


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["method", "route", "status"]
        self.requests = Counter("loraq_http_requests", "HTTP requests handled", labels, registry=registry)
        self.latency = Histogram(
            "loraq_http_request_duration_seconds",
            "Time from request start to the end of the response body",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


class RequestMetricsMiddleware:
    """Pure ASGI middleware (streams untouched): counts and times every HTTP request.

    The route template is read from `scope["route"]`, which Starlette's router sets on the shared
    scope once it has matched; requests that match no route share one label value.
    """

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client sees if the app raises before starting a response

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED_ROUTE
            labels = (scope["method"], route, str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - start)


@dataclass
class StoredCounts:
    files: int
    file_bytes: int
    artifacts: int
    artifact_bytes: int
    checkpoints: int = 0


@dataclass
class StateSources:
    """Where `ServiceStateCollector` reads from; each returns fresh values or raises."""

    jobs_by_status: Callable[[], dict[str, int]]
    stored: Callable[[], StoredCounts]
    queue_depth: Callable[[], dict[str, int]]  # queue name -> messages waiting
    unacked: Callable[[], int]
    workers_alive: Callable[[], int]


class ServiceStateCollector(Collector):
    """Scrape-time gauges of the service's state. `job_statuses` are always emitted (0 if none)."""

    def __init__(self, sources: StateSources, job_statuses: tuple[str, ...]) -> None:
        self.sources = sources
        self.job_statuses = job_statuses

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "loraq_scrape_source_up", "1 when the source answered during this scrape", labels=["source"]
        )
        for name, read in (
            ("database_jobs", self._jobs),
            ("database_store", self._stored),
            ("redis_queue", self._queue),
            ("redis_workers", self._workers),
        ):
            try:
                families = list(read())
            except Exception:
                log.warning("metrics source %s failed", name, exc_info=True)
                up.add_metric([name], 0.0)
                continue
            up.add_metric([name], 1.0)
            yield from families
        yield up

    def _jobs(self) -> Iterator[GaugeMetricFamily]:
        counts = self.sources.jobs_by_status()
        family = GaugeMetricFamily("loraq_jobs", "Fine-tuning jobs by status", labels=["status"])
        for status in sorted(set(self.job_statuses) | set(counts)):
            family.add_metric([status], float(counts.get(status, 0)))
        yield family

    def _stored(self) -> Iterator[GaugeMetricFamily]:
        s = self.sources.stored()
        yield GaugeMetricFamily("loraq_files_stored", "Uploaded and result files stored", value=s.files)
        yield GaugeMetricFamily("loraq_files_stored_bytes", "Bytes of stored files", value=s.file_bytes)
        yield GaugeMetricFamily(
            "loraq_artifacts_stored", "Job artifacts stored (adapters, results)", value=s.artifacts
        )
        yield GaugeMetricFamily(
            "loraq_artifacts_stored_bytes", "Bytes of stored job artifacts", value=s.artifact_bytes
        )
        yield GaugeMetricFamily(
            "loraq_checkpoints_stored", "Training checkpoints stored", value=s.checkpoints
        )

    def _queue(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("loraq_queue_depth", "Job messages waiting in Redis", labels=["queue"])
        for queue, n in sorted(self.sources.queue_depth().items()):
            depth.add_metric([queue], float(n))
        yield depth
        yield GaugeMetricFamily(
            "loraq_queue_unacked", "Job messages delivered to a worker, not yet acknowledged",
            value=self.sources.unacked(),
        )  # fmt: skip

    def _workers(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "loraq_workers_alive", "Workers whose registry entry is fresh", value=self.sources.workers_alive()
        )


def metrics_token(settings: Settings) -> str:
    """The token /metrics wants: `metrics_bearer_token`, else the one in `<data_dir>/metrics_token`
    (generated on first use; read at each scrape, so replacing the file rotates it)."""
    if settings.metrics_bearer_token:
        return settings.metrics_bearer_token
    return read_or_create(settings.resolved_data_dir / METRICS_TOKEN_FILE, lambda: secrets.token_urlsafe(32))


def check_metrics_token(request: Request) -> None:
    """/metrics answers only `Authorization: Bearer <metrics_token>`; 401 otherwise."""
    token = metrics_token(get_settings())
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise AuthenticationError(
            f"/metrics needs 'Authorization: Bearer <token>': LORAQ_METRICS_BEARER_TOKEN, else the "
            f"token in {METRICS_TOKEN_FILE} of the API's data dir"
        )


def metrics_endpoint(registry: CollectorRegistry) -> Callable[[Request], Response]:
    def metrics(request: Request) -> Response:
        check_metrics_token(request)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return metrics


def install_metrics(app: FastAPI, sources: StateSources, job_statuses: tuple[str, ...]) -> CollectorRegistry:
    """Add the request middleware and `GET /metrics` to `app`; return the app's registry."""
    registry = CollectorRegistry()
    app.add_middleware(RequestMetricsMiddleware, metrics=RequestMetrics(registry))
    registry.register(ServiceStateCollector(sources, job_statuses))
    app.add_api_route(
        "/metrics", metrics_endpoint(registry), methods=["GET"], include_in_schema=False, name="metrics"
    )
    app.state.metrics_registry = registry
    return registry


# --------------------------------------------------------------------------- the service's sources
def service_sources(settings: Settings) -> StateSources:
    """The real sources: the service database (all tenants) and the broker's Redis."""
    from sqlalchemy import func, select

    from service import worker_registry
    from service.db.models import Artifact, Checkpoint, File, Job
    from service.db.session import session_scope

    client = redis_client(settings)

    def jobs_by_status() -> dict[str, int]:
        with session_scope() as session:
            rows = session.execute(select(Job.status, func.count()).group_by(Job.status)).all()
        return {str(status): int(n) for status, n in rows}

    def stored() -> StoredCounts:
        with session_scope() as session:
            files, file_bytes = session.execute(
                select(func.count(), func.coalesce(func.sum(File.bytes), 0))
            ).one()
            arts, art_bytes = session.execute(
                select(func.count(), func.coalesce(func.sum(Artifact.bytes), 0))
            ).one()
            ckpts = session.scalar(select(func.count()).select_from(Checkpoint)) or 0
        return StoredCounts(int(files), int(file_bytes), int(arts), int(art_bytes), int(ckpts))

    return StateSources(
        jobs_by_status=jobs_by_status,
        stored=stored,
        queue_depth=lambda: {settings.worker_queue: kombu_queue_depth(client, settings.worker_queue)},
        unacked=lambda: int(client.hlen(KOMBU_UNACKED_KEY)),
        workers_alive=lambda: len(worker_registry.worker_nodes(client)),
    )


class UpRestartsCollector(Collector):
    """`loraq_up_restarts_total{child}`: restarts of `loraq up`'s children, read from the file its
    supervisor keeps in the data dir (nothing when the API runs without `loraq up`)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            counts = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        family = CounterMetricFamily(
            "loraq_up_restarts", "Children of `loraq up` restarted after an unexpected exit", labels=["child"]
        )
        for child, n in sorted(counts.items()):
            family.add_metric([str(child)], float(n))
        yield family


def install_service_metrics(app: FastAPI, settings: Settings) -> CollectorRegistry:
    """What `create_app()` calls: request metrics + /metrics over the service's real sources.
    The token is made now, so its file exists once the API runs."""
    metrics_token(settings)
    registry = install_metrics(app, service_sources(settings), JOB_STATUSES)
    registry.register(UpRestartsCollector(settings.resolved_data_dir / RESTARTS_FILE))
    return registry
