"""The worker registry in Redis, which the dashboard's Workers page and the API read (key names in
`service.worker_registry`):

- `loraq:workers:<node>`      JSON: hostname, pid, metrics port, queue, kernels, GPUs, last_seen,
                              and `consumer` (whether its consumer is taking messages:
                              worker/consumer_watch.py); refreshed every `REGISTRY_INTERVAL_SECONDS`
                              by a thread of the main process (`RegistryBeat`), expires after
                              `REGISTRY_TTL_SECONDS` without a refresh.
- `loraq:workers:<node>:job`  JSON: the job the worker runs (id, model, step, total), written by
                              the process running it (`record_job`); deleted when the job ends.

During a Redis outage these writes are skipped until the backoff since the last failure is over
(one `DependencyHealth` per process), so a training step never waits on a Redis timeout, and the
outage is logged once.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import redis

from service.dependency import DependencyHealth
from service.redis_client import REDIS_OUTAGE, redis_client
from service.settings import Settings, get_settings
from service.worker_registry import job_key, worker_key
from worker import consumer_watch
from worker.metrics.gpus import local_gpus

log = logging.getLogger("loraq.worker.metrics")

REGISTRY_INTERVAL_SECONDS = 5.0
REGISTRY_TTL_SECONDS = 30
JOB_KEY_TTL_SECONDS = 120
# Not a setting: the main process sets it for its pool children (forked after the settings were
# read), so that they write the registry entry of the node that serves their metrics.
NODE_ENV = "LORAQ_WORKER_NODE"


def node_id() -> str:
    """This worker's id: set by the main process before the pool forks, so children share it."""
    return os.environ.get(NODE_ENV) or f"{socket.gethostname()}:{os.getpid()}"


_redis_client: redis.Redis | None = None
_health = DependencyHealth("Redis (worker registry)", log)


def _redis(settings: Settings | None = None) -> redis.Redis:
    global _redis_client
    if _redis_client is None:
        _redis_client = redis_client(settings or get_settings())
    return _redis_client


def _write(what: str, write: Callable[[redis.Redis], object]) -> None:
    """One registry write, skipped during an outage's backoff. Never raises."""
    if not _health.may_try():
        return
    try:
        write(_redis())
        _health.ok()
    except REDIS_OUTAGE as exc:
        _health.failed(exc)
    except Exception:
        log.warning("registry: could not %s", what, exc_info=True)


def record_job(body: dict[str, Any]) -> None:
    """Write this worker's `loraq:workers:<node>:job`. Never raises: the registry is for reading."""
    if not os.environ.get(NODE_ENV):  # not inside a started worker (a test calling the runner)
        return
    _write(
        "record the current job",
        lambda r: r.set(job_key(node_id()), json.dumps(body), ex=JOB_KEY_TTL_SECONDS),
    )


def clear_job() -> None:
    """Delete this worker's `loraq:workers:<node>:job`. Never raises."""
    if not os.environ.get(NODE_ENV):
        return
    _write("clear the current job", lambda r: r.delete(job_key(node_id())))


_kernels: dict[str, Any] = {}


def kernels_status() -> dict[str, Any]:
    """`gpu_kernels.available()` as JSON, cached: whether the compiled kernels are in use."""
    if not _kernels:
        try:
            import gpu_kernels

            status = gpu_kernels.available()
            _kernels.update(compiled=bool(status.compiled), reason=status.reason)
        except Exception as e:
            _kernels.update(compiled=False, reason=f"gpu_kernels failed to load: {e}")
    return dict(_kernels)


def registry_entry(
    *, node: str, metrics_port: int | None, queue: str, started_at: float, settings: Settings
) -> dict[str, Any]:
    from worker.metric_sinks import available_integrations

    return {
        "node": node,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "queue": queue,
        "metrics_port": metrics_port,
        "started_at": started_at,
        "last_seen": time.time(),
        "kernels": kernels_status(),
        "gpus": [asdict(g) for g in local_gpus()],
        "consumer": watch.status() if (watch := consumer_watch.current()) is not None else None,
        # what its jobs' `integrations` may ask (service/integrations.py: refused at submit otherwise)
        "integrations": available_integrations(settings),
    }


class RegistryBeat:
    """Thread of the main worker process: refresh `loraq:workers:<node>` until stopped."""

    def __init__(self, *, node: str, metrics_port: int | None, settings: Settings) -> None:
        self.node = node
        self.metrics_port = metrics_port
        self.settings = settings
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraq-registry", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        entry = registry_entry(
            node=self.node,
            metrics_port=self.metrics_port,
            queue=self.settings.worker_queue,
            started_at=self.started_at,
            settings=self.settings,
        )
        _redis(self.settings).set(worker_key(self.node), json.dumps(entry), ex=REGISTRY_TTL_SECONDS)
        _health.ok()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            _redis(self.settings).delete(worker_key(self.node), job_key(self.node))
        except Exception:
            log.warning("registry: could not remove %s", self.node, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(REGISTRY_INTERVAL_SECONDS):
            try:
                self.beat()
            except REDIS_OUTAGE as exc:  # the next beat retries; the entry expires meanwhile
                _health.failed(exc)
            except Exception:
                log.warning("registry beat failed", exc_info=True)
