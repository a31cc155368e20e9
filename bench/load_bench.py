"""Load benchmark: N concurrent clients submit and poll fine-tuning jobs while a worker trains.

`loraq up` runs on this machine (API, one worker, its own redis-server; SQLite unless
`--database-url`), with the default per-tenant job limits and per-key rate limit on. Each client
is a tenant of its own with its own API key and loops until the time is up: submit a tiny-llama
job, poll its status every `--poll` seconds until it ends, submit the next. Then submitting
stops and every accepted job is waited for (at most `--drain-seconds`).

Reports p50/p99 latency of submits and of status polls, the error rate (non-2xx answers and
transport errors over all requests), and jobs lost: accepted jobs (200 on submit) that are not
`succeeded` once drained. Jobs lost must be 0; the exit status is 1 otherwise.

Bounded on purpose: at most 64 clients and 300 s of load, loopback (127.0.0.1) only.

Usage: .venv/bin/python bench/load_bench.py [--clients 16] [--seconds 60] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from service.job_status import TERMINAL

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.service_bench import Service, summary_ms, write_report

MAX_CLIENTS = 64
MAX_SECONDS = 300.0
DATASET = "".join(
    json.dumps(
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ]
        }
    )
    + "\n"
    for i in range(8)
).encode()


class Stats:
    def __init__(self) -> None:
        self.submit: list[float] = []
        self.poll: list[float] = []
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.accepted: dict[str, str] = {}  # job id -> the key that owns it

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def client_loop(
    url: str, key: str, file_id: str, body: dict[str, Any], deadline: float, poll: float, stats: Stats
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url + "/v1", headers=headers, timeout=30) as c:
        while time.monotonic() < deadline:
            t = time.perf_counter()
            stats.requests += 1
            try:
                r = await c.post("/fine_tuning/jobs", json={**body, "training_file": file_id})
            except httpx.HTTPError as e:
                stats.error(f"submit {type(e).__name__}")
                await asyncio.sleep(poll)
                continue
            stats.submit.append(time.perf_counter() - t)
            if r.status_code != 200:
                stats.error(f"submit {r.status_code}")
                await asyncio.sleep(float(r.headers.get("Retry-After", poll)))
                continue
            job_id = r.json()["id"]
            stats.accepted[job_id] = key
            while time.monotonic() < deadline:
                await asyncio.sleep(poll)
                t = time.perf_counter()
                stats.requests += 1
                try:
                    r = await c.get(f"/fine_tuning/jobs/{job_id}")
                except httpx.HTTPError as e:
                    stats.error(f"poll {type(e).__name__}")
                    continue
                stats.poll.append(time.perf_counter() - t)
                if r.status_code != 200:
                    stats.error(f"poll {r.status_code}")
                elif r.json()["status"] in TERMINAL:
                    break


def make_keys(data_dir: Path, n: int) -> list[str]:
    """One tenant and key per client, written to `loraq up`'s database with its server secret."""
    os.environ["LORAQ_DATA_DIR"] = str(data_dir)
    if url := os.environ.get("LOADBENCH_DATABASE_URL"):
        os.environ["LORAQ_DATABASE_URL"] = url
    from service.auth import create_key
    from service.db.session import session_scope
    from service.settings import get_settings

    get_settings.cache_clear()
    with session_scope() as s:
        return [create_key(s, f"load-client-{i}") for i in range(n)]


def drain(url: str, accepted: dict[str, str], timeout: float) -> dict[str, int]:
    """Wait for every accepted job to end; count how each ended (`lost`: not found or not ended)."""
    deadline = time.monotonic() + timeout
    final: dict[str, str] = {}
    with httpx.Client(base_url=url + "/v1", timeout=30) as c:
        pending = dict(accepted)
        while pending and time.monotonic() < deadline:
            for job_id, key in list(pending.items()):
                r = c.get(f"/fine_tuning/jobs/{job_id}", headers={"Authorization": f"Bearer {key}"})
                status = r.json()["status"] if r.status_code == 200 else f"http {r.status_code}"
                if status in TERMINAL or status.startswith("http 404"):
                    final[job_id] = status
                    del pending[job_id]
            time.sleep(0.5)
        final.update(dict.fromkeys(pending, "not finished"))
    counts: dict[str, int] = {}
    for status in final.values():
        counts[status] = counts.get(status, 0) + 1
    counts["lost"] = sum(1 for s in final.values() if s != "succeeded")
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0, help="how long clients submit and poll")
    ap.add_argument("--poll", type=float, default=0.1, help="seconds between a client's status polls")
    ap.add_argument("--epochs", type=int, default=2, help="n_epochs of each job (8 examples, batch 4)")
    ap.add_argument("--drain-seconds", type=float, default=300.0)
    ap.add_argument("--database-url", default=None, help="LORAQ_DATABASE_URL (default: SQLite)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    if not 1 <= args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        ap.error(f"--clients must be 1..{MAX_CLIENTS} and --seconds in (0, {MAX_SECONDS:g}]")

    # `loraq up` with the shipped defaults for limits (service_bench turns them off for its own
    # single-key throughput measurement).
    extra_env = {"LORAQ_MAX_QUEUED_JOBS_PER_TENANT": "20", "LORAQ_RATE_LIMIT_PER_MINUTE": "6000"}
    if args.database_url:
        extra_env["LORAQ_DATABASE_URL"] = args.database_url
        os.environ["LOADBENCH_DATABASE_URL"] = args.database_url
    body = {
        "model": "tiny-llama",
        "suffix": "load",
        "hyperparameters": {"n_epochs": args.epochs, "batch_size": 4},
        "lora": {"r": 4, "alpha": 8},
        "max_seq_len": 64,
    }
    with tempfile.TemporaryDirectory(prefix="loraq-load-") as tmp:
        svc = Service(Path(tmp) / "var", extra_env)
        try:
            svc.wait_ready()
            assert httpx.URL(svc.url).host == "127.0.0.1"  # loopback only
            keys = make_keys(svc.data_dir, args.clients)
            file_ids = []
            for key in keys:
                r = httpx.post(
                    svc.url + "/v1/files",
                    headers={"Authorization": f"Bearer {key}"},
                    data={"purpose": "fine-tune"},
                    files={"file": ("train.jsonl", DATASET)},
                )
                r.raise_for_status()
                file_ids.append(r.json()["id"])
            stats = Stats()
            start = time.monotonic()
            deadline = start + args.seconds
            load_before = os.getloadavg()[0]

            async def run() -> None:
                await asyncio.gather(
                    *(
                        client_loop(svc.url, k, f, body, deadline, args.poll, stats)
                        for k, f in zip(keys, file_ids, strict=True)
                    )
                )

            asyncio.run(run())
            load_seconds = time.monotonic() - start
            load_after = os.getloadavg()[0]
            outcome = drain(svc.url, stats.accepted, args.drain_seconds)
            drain_seconds = time.monotonic() - start - load_seconds
        finally:
            svc.stop()

    n_errors = sum(stats.errors.values())
    results = {
        "clients": args.clients,
        "load_seconds": round(load_seconds, 2),
        "drain_seconds": round(drain_seconds, 2),
        "requests": stats.requests,
        "requests_per_s": round(stats.requests / load_seconds, 1),
        "errors": n_errors,
        "error_rate": round(n_errors / max(1, stats.requests), 5),
        "errors_by_kind": stats.errors,
        "submit": summary_ms(stats.submit) if stats.submit else {},
        "poll": summary_ms(stats.poll) if stats.poll else {},
        "jobs_accepted": len(stats.accepted),
        "jobs_by_final_status": {k: v for k, v in outcome.items() if k != "lost"},
        "jobs_lost": outcome["lost"],
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(load_after, 2),
    }
    targets = {"jobs_lost_is_0": results["jobs_lost"] == 0}
    write_report("load", args, {"job": body, "results": results, "targets_met": targets})
    return 0 if results["jobs_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
