"""The worker's `/metrics` server and the Celery signal hooks that start and stop it.

The worker's main process serves `/metrics` on `settings.worker_metrics_port` (started by Celery's
`worker_init`, before any pool forks), merging the training series every process wrote
(`worker.metrics.training`), the live jobs' gauges (`worker.metrics.live_jobs`), the GPUs'
(`worker.metrics.gpus`) and the consumer's (`loraq_redis_up`, `loraq_worker_consuming`:
`worker.consumer_watch`); it also keeps this worker's registry entry fresh (`worker.metrics.registry`).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.settings import Settings, get_settings
from worker.consumer_watch import ConsumerCollector
from worker.metrics.gpus import NvmlCollector
from worker.metrics.live_jobs import LiveJobCollector, clear_live_job
from worker.metrics.registry import NODE_ENV, RegistryBeat, kernels_status
from worker.metrics.training import prepare_multiprocess_dir, training_metrics

log = logging.getLogger("loraq.worker.metrics")


@dataclass
class WorkerMetricsServer:
    node: str
    port: int
    multiproc_dir: Path
    beat: RegistryBeat
    httpd: Any

    def stop(self) -> None:
        self.beat.stop()
        self.httpd.shutdown()
        self.httpd.server_close()
        shutil.rmtree(self.multiproc_dir, ignore_errors=True)  # this worker's values die with it


def start_worker_metrics(settings: Settings | None = None, *, port: int | None = None) -> WorkerMetricsServer:
    """In the worker's main process, before the pool forks: multiprocess dir, HTTP server, registry.

    `port` 0 picks a free port (the chosen one is in the registry entry and the return value).
    """
    settings = settings or get_settings()
    node = f"{socket.gethostname()}:{os.getpid()}"
    os.environ[NODE_ENV] = node  # inherited by the pool children
    multiproc_dir = settings.resolved_data_dir / "prometheus" / f"worker-{os.getpid()}"
    prepare_multiprocess_dir(multiproc_dir)

    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))
    registry.register(LiveJobCollector(multiproc_dir))
    registry.register(NvmlCollector(node=node))
    registry.register(ConsumerCollector())
    bind_port = settings.worker_metrics_port if port is None else port
    host = settings.worker_metrics_host or settings.host
    try:
        httpd, _thread = start_http_server(bind_port, addr=host, registry=registry)
    except OSError as e:
        # Another worker on this host holds the port: serve on a free one rather than not at
        # all; the registry entry (Workers page) names the port actually used.
        log.warning("worker metrics port %d unavailable (%s); using a free port", bind_port, e)
        httpd, _thread = start_http_server(0, addr=host, registry=registry)
    actual_port = int(httpd.server_port)
    # The main process's own gauge: so the series exists before the first job runs.
    training_metrics().compiled_kernels.set(1.0 if kernels_status()["compiled"] else 0.0)
    beat = RegistryBeat(node=node, metrics_port=actual_port, settings=settings)
    beat.start()
    log.info("worker metrics on http://%s:%d/metrics (node %s)", host, actual_port, node)
    return WorkerMetricsServer(node, actual_port, multiproc_dir, beat, httpd)


def mark_child_dead(pid: int) -> None:
    """Drop a dead pool child's live gauges and live-job file (Celery's worker_process_shutdown)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
        clear_live_job(pid)  # a child killed mid-job never deleted its file


_server: WorkerMetricsServer | None = None


def on_worker_init() -> None:
    """Celery `worker_init` (main process, before the pool forks). A failure only loses metrics."""
    global _server
    try:
        _server = start_worker_metrics()
    except Exception:
        log.exception("worker metrics could not start; the worker runs without /metrics")


def on_worker_shutdown() -> None:
    """Celery `worker_shutdown`: stop serving and drop this worker's registry entry."""
    global _server
    if _server is not None:
        try:
            _server.stop()
        except Exception:
            log.warning("worker metrics did not stop cleanly", exc_info=True)
        _server = None


def on_pool_process_exit(pid: int) -> None:
    """Celery `worker_process_shutdown`: a pool child exits; its live gauges must go with it."""
    try:
        mark_child_dead(pid)
    except Exception:
        log.warning("could not mark pool process %d dead", pid, exc_info=True)
