"""The worker registry in Redis: key names shared by the writer (`worker.metrics`) and the readers
(the dashboard's Workers page, the API's `loraq_workers_alive`).

- `loraq:workers:<node>`      JSON written by the worker's main process every few seconds, with a
                              TTL, so a dead worker disappears on its own;
- `loraq:workers:<node>:job`  JSON of the job that worker runs, written by the process running it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger("loraq.registry")

PREFIX = "loraq:workers:"
JOB_SUFFIX = ":job"


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
