"""The worker registry in Redis: key names shared by the writer (`worker.metrics`) and the readers
(the dashboard's Workers page, the API's `loraq_workers_alive`).

- `loraq:workers:<node>`      JSON written by the worker's main process every few seconds, with a
                              TTL, so a dead worker disappears on its own;
- `loraq:workers:<node>:job`  JSON of the job that worker runs, written by the process running it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from service.redis_client import redis_client
from service.settings import Settings, get_settings

log = logging.getLogger("loraq.registry")

PREFIX = "loraq:workers:"
JOB_SUFFIX = ":job"
LIVE_CACHE_SECONDS = 2.0  # submits read the registry at most this often per API process


@dataclass
class GpuSample:
    """One GPU of a worker's entry, as NVML read it (`worker.metrics.gpus`)."""

    index: int
    uuid: str
    name: str
    utilization_percent: float
    memory_used_bytes: float
    memory_total_bytes: float
    temperature_celsius: float
    power_watts: float
    sm_clock_hertz: float


def worker_key(node: str) -> str:
    return f"{PREFIX}{node}"


def job_key(node: str) -> str:
    return f"{PREFIX}{node}{JOB_SUFFIX}"


def worker_nodes(client: Any) -> list[str]:
    """Nodes whose registry entry has not expired, sorted."""
    nodes = []
    for raw in client.scan_iter(match=f"{PREFIX}*", count=500):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        if not key.endswith(JOB_SUFFIX):
            nodes.append(key[len(PREFIX) :])
    return sorted(nodes)


def list_workers(client: Any) -> list[dict[str, Any]]:
    """Every live worker's entry, with `job` set to its current job (or None)."""
    nodes = worker_nodes(client)
    if not nodes:
        return []
    values = client.mget([k for n in nodes for k in (worker_key(n), job_key(n))])
    workers = []
    for i, node in enumerate(nodes):
        entry_raw, job_raw = values[2 * i], values[2 * i + 1]
        if entry_raw is None:  # expired between SCAN and MGET
            continue
        try:
            entry = json.loads(entry_raw)
            entry["job"] = json.loads(job_raw) if job_raw is not None else None
        except ValueError:
            log.warning("registry entry of %s is not JSON; skipped", node)
            continue
        workers.append(entry)
    return workers


def served_integrations(workers: list[dict[str, Any]]) -> dict[str, set[str]]:
    """Each Celery queue the `workers` (`list_workers`) consume → the integrations
    (service/integrations.py) that at least one of them can log (a worker too old to say counts as
    able: nothing is refused on it)."""
    served: dict[str, set[str]] = {}
    for w in workers:
        if w.get("queue"):
            can = w.get("integrations", ["wandb", "mlflow"])
            served.setdefault(str(w["queue"]), set()).update(str(i) for i in can)
    return served


def unserved_reason(queue: str, n_gpus: int, celery_queue: str, served: set[str]) -> str | None:
    """Why no live worker would take a job routed to `celery_queue`, in words; None if one would."""
    if celery_queue in served:
        return None
    if n_gpus > 1 and queue in served:
        sizes = sorted(
            int(q.rsplit("-x", 1)[1])
            for q in served
            if q.startswith(f"{queue}-x") and q.rsplit("-x", 1)[1].isdigit()
        )
        most = max(sizes, default=1)
        return f"n_gpus {n_gpus}: the workers of queue {queue!r} run jobs of at most {most} GPU(s)"
    live = ", ".join(sorted(served)) or "none"
    return f"queue {queue!r}: no registered worker serves it (queues served now: {live})"


_default: tuple[Settings, Any] | None = None


def default_client() -> Any:
    """A client for the registry's Redis, reused while the settings stay the same."""
    global _default
    settings = get_settings()
    if _default is None or _default[0] != settings:
        _default = (settings, redis_client(settings))
    return _default[1]


_live: tuple[float, list[dict[str, Any]] | None] = (float("-inf"), None)
_live_lock = threading.Lock()


def live_workers_now() -> list[dict[str, Any]] | None:
    """`list_workers` of the default client, cached for `LIVE_CACHE_SECONDS` (a submit's checks of
    queues, integrations and GPU memory share one read); None when Redis cannot be read (then
    nothing is known, and the caller must not refuse on it)."""
    global _live
    from service.queue import broker_paused

    with _live_lock:
        at, value = _live
        if time.monotonic() - at < LIVE_CACHE_SECONDS:
            return value
        value = None
        if not broker_paused():  # a publish just failed: do not wait on Redis again
            try:
                value = list_workers(default_client())
            except Exception:
                log.warning("worker registry unreadable; submits are not checked against it", exc_info=True)
        _live = (time.monotonic(), value)
        return value


def forget_live_workers() -> None:
    """The next `live_workers_now` reads the registry again (tests that just wrote an entry)."""
    global _live
    with _live_lock:
        _live = (float("-inf"), None)


def served_queues_now() -> set[str] | None:
    """The Celery queues live workers consume (`h100`, `h100-x2`, ...), as `live_workers_now`."""
    served = served_integrations_now()
    return None if served is None else set(served)


def served_integrations_now() -> dict[str, set[str]] | None:
    """`served_integrations` of `live_workers_now`."""
    workers = live_workers_now()
    return None if workers is None else served_integrations(workers)
