"""Service benchmark: `loraq up` on this machine, measured from a client on loopback.

Measures
- submit latency: POST /v1/fine_tuning/jobs, p50/p99 (each job is cancelled right after);
- dispatch latency: submit → status `running` with an idle worker, p50/p99 (polled every 5 ms,
  so figures carry up to 5 ms of polling error; each job is cancelled once running and the next
  one is submitted only after the worker is idle again);
- status reads: GET /v1/fine_tuning/jobs/{id} from N concurrent keep-alive connections for a
  fixed time: throughput and p50/p99 latency.

Targets: dispatch p99 < 1 s; >= 2,000 status reads/s with p99 <= 50 ms; on PostgreSQL within 10%
of SQLite's figure (two runs, `--database-url` on one of them, on the same machine at the same
hour).

The read load uses a minimal HTTP/1.1 keep-alive client on raw asyncio streams: on a 2-core
machine a full HTTP client library would spend more CPU than the server and measure itself.

Usage: .venv/bin/python bench/service_bench.py [--clients 16] [--read-seconds 10] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import httpx
import psutil

from service.job_status import TERMINAL
from worker.engine.versions import package_versions

ROOT = Path(__file__).resolve().parents[1]
DATASET_LINE = {
    "messages": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ]
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`, in the values' unit."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 2),
        "p99_ms": round(pct(ms, 99), 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "max_ms": round(max(ms), 2),
    }


class Service:
    """`loraq up` in a subprocess with its own data dir and its own redis-server."""

    def __init__(self, data_dir: Path, extra_env: dict[str, str]) -> None:
        self.port = free_port()
        self.key = "sk-bench-" + secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
        env.update(LORAQ_DATA_DIR=str(data_dir), LORAQ_PORT=str(self.port), LORAQ_API_KEY=self.key)
        # One key submits 100 jobs and reads ~1,000/s: a throughput measurement, not a tenant, so
        # the per-tenant queued-job limit and (unless --rate-limit-per-minute) the per-key rate
        # limit are off.
        env.update(LORAQ_MAX_QUEUED_JOBS_PER_TENANT="0", LORAQ_RATE_LIMIT_PER_MINUTE="0")
        env.update(extra_env)
        self.data_dir = data_dir
        self.log = (data_dir.parent / "up.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "up"], cwd=ROOT, env=env, stdout=self.log, stderr=self.log
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until the API answers /readyz and the worker has finished starting (an idle worker)."""
        worker_log = self.data_dir / "logs" / "worker.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"loraq up exited with {self.proc.returncode}; see {self.log.name}")
            try:
                api_ok = httpx.get(self.url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                api_ok = False
            if api_ok and worker_log.exists() and b" ready." in worker_log.read_bytes():
                return
            time.sleep(0.2)
        raise RuntimeError("loraq up not ready in time")

    def api_cpu_seconds(self) -> float:
        """CPU time used so far by the API process and its children (uvicorn workers)."""
        pids = json.loads((self.data_dir / "up.pids.json").read_text())
        api = psutil.Process(pids["api"])
        total = 0.0
        for p in [api, *api.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        self.log.close()


def wait_status(c: httpx.Client, job_id: str, statuses: Collection[str], timeout: float, poll: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = str(c.get(f"/fine_tuning/jobs/{job_id}").json()["status"])
        if status in statuses:
            return status
        time.sleep(poll)
    raise TimeoutError(f"{job_id} not in {statuses} after {timeout}s")


def bench_submit(c: httpx.Client, body: dict[str, Any], n: int) -> list[float]:
    latencies = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = c.post("/fine_tuning/jobs", json=body)
        latencies.append(time.perf_counter() - t0)
        r.raise_for_status()
        c.post(f"/fine_tuning/jobs/{r.json()['id']}/cancel").raise_for_status()
    return latencies


def wait_idle(c: httpx.Client, timeout: float = 300.0) -> None:
    """Until no job of ours is queued or running (the worker is idle)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page = c.get("/fine_tuning/jobs", params={"limit": 100}).json()
        if all(j["status"] in TERMINAL for j in page["data"]):
            return
        time.sleep(0.1)
    raise TimeoutError("worker did not become idle")


def bench_dispatch(c: httpx.Client, body: dict[str, Any], n: int) -> list[float]:
    latencies = []
    for _ in range(n):
        wait_idle(c)
        t0 = time.perf_counter()
        job_id = c.post("/fine_tuning/jobs", json=body).json()["id"]
        wait_status(c, job_id, {"running", *TERMINAL}, timeout=30, poll=0.005)
        latencies.append(time.perf_counter() - t0)
        c.post(f"/fine_tuning/jobs/{job_id}/cancel")
        wait_status(c, job_id, TERMINAL, timeout=120, poll=0.05)
    return latencies


async def _reader(
    port: int, request: bytes, stop_at: float, latencies: list[float], errors: list[str]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b" ", 2)[1]
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            latencies.append(time.perf_counter() - t0)
            if status != b"200":
                errors.append(status.decode())
    finally:
        writer.close()


async def bench_reads(port: int, key: str, job_id: str, clients: int, seconds: float) -> dict[str, Any]:
    request = (
        f"GET /v1/fine_tuning/jobs/{job_id} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nAccept: application/json\r\n\r\n"
    ).encode()
    latencies: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    stop_at = start + seconds
    await asyncio.gather(*(_reader(port, request, stop_at, latencies, errors) for _ in range(clients)))
    elapsed = time.perf_counter() - start
    return {
        "clients": clients,
        "seconds": round(elapsed, 2),
        "requests": len(latencies),
        "non_200": len(errors),
        "reads_per_s": round(len(latencies) / elapsed, 1),
        **summary_ms(latencies),
    }


def device_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16, help="concurrent connections for status reads")
    ap.add_argument("--read-seconds", type=float, default=10.0)
    ap.add_argument("--submits", type=int, default=100)
    ap.add_argument("--dispatches", type=int, default=30)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument(
        "--database-url", default=None, help="LORAQ_DATABASE_URL (default: SQLite in the data dir)"
    )
    ap.add_argument(
        "--rate-limit-per-minute",
        type=int,
        default=0,
        help="LORAQ_RATE_LIMIT_PER_MINUTE (default 0: off); above the read load, it measures the "
        "limiter's Redis round trip on every request without refusing any",
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="", help="free text stored with the results (what was going on)")
    args = ap.parse_args()

    extra_env = {"LORAQ_DATABASE_URL": args.database_url} if args.database_url else {}
    extra_env["LORAQ_RATE_LIMIT_PER_MINUTE"] = str(args.rate_limit_per_minute)
    with tempfile.TemporaryDirectory(prefix="loraq-bench-") as tmp:
        svc = Service(Path(tmp) / "var", extra_env)
        try:
            svc.wait_ready()
            c = httpx.Client(
                base_url=svc.url + "/v1", headers={"Authorization": f"Bearer {svc.key}"}, timeout=30
            )
            data = "\n".join(json.dumps(DATASET_LINE) for _ in range(8)).encode() + b"\n"
            file_id = c.post(
                "/files", data={"purpose": "fine-tune"}, files={"file": ("d.jsonl", data)}
            ).json()["id"]
            body = {"model": args.model, "training_file": file_id, "hyperparameters": {"n_epochs": 50}}

            submit = bench_submit(c, body, args.submits)
            wait_idle(c)
            dispatch = bench_dispatch(c, body, args.dispatches)
            wait_idle(c)
            job_id = c.get("/fine_tuning/jobs", params={"limit": 1}).json()["data"][0]["id"]
            load_before = os.getloadavg()[0]
            cpu_before, client_before = svc.api_cpu_seconds(), time.process_time()
            reads = asyncio.run(bench_reads(svc.port, svc.key, job_id, args.clients, args.read_seconds))
            # The load generator shares the machine: its own CPU per read bounds what can be measured.
            reads["client_cpu_ms_per_read"] = round(
                (time.process_time() - client_before) / reads["requests"] * 1e3, 3
            )
            # Server CPU per read: the API's own cost, separate from how much CPU it could get on
            # a shared machine (the load average says how busy the machine was).
            reads["api_cpu_ms_per_read"] = round(
                (svc.api_cpu_seconds() - cpu_before) / reads["requests"] * 1e3, 3
            )
            reads["loadavg_1m_before"] = round(load_before, 2)
            reads["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
            c.close()
        finally:
            svc.stop()

    results = {
        "submit": summary_ms(submit),
        "dispatch": summary_ms(dispatch),
        "status_reads": reads,
    }
    targets = {
        "dispatch_p99_under_1s": results["dispatch"]["p99_ms"] < 1000,
        "reads_at_least_1000_per_s": reads["reads_per_s"] >= 1000,
        "reads_p99_under_100ms": reads["p99_ms"] < 100,
        # PostgreSQL keeps up with SQLite (compare the two databases' runs)
        "reads_at_least_2000_per_s": reads["reads_per_s"] >= 2000,
        "reads_p99_at_most_50ms": reads["p99_ms"] <= 50,
    }
    body = {"rate_limit_per_minute": args.rate_limit_per_minute, "results": results, "targets_met": targets}
    write_report("service", args, body)
    return 0 if all(targets.values()) else 1


def write_report(benchmark: str, args: argparse.Namespace, body: dict[str, Any]) -> None:
    """Write (and print) `body` with what every result file carries: date, commit, command,
    device, database and note; to --out or bench/results/<benchmark>-<date>.json."""
    now = dt.datetime.now(dt.UTC)
    report = {
        "benchmark": benchmark,
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device_info(),
        "versions": package_versions(),
        "database": args.database_url.split("://")[0] if args.database_url else "sqlite",
        **body,
        "note": args.note,
    }
    out = args.out or ROOT / "bench" / "results" / f"{benchmark}-{now:%Y-%m-%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
