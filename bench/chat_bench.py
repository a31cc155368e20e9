"""Chat completions benchmark: `loraq up` on this machine, one client on loopback.

Measures, with a warm idle inference worker (tiny-llama preloaded, a few warm-up requests):
- non-streamed completions of `--max-tokens` tokens (greedy), one at a time: wall latency
  p50/p99 from the client (HTTP, auth, model lookup, Redis both ways, decoding);
- streamed completions, one at a time: time to the first content chunk, p50/p99.

Target (issue 14): non-streamed 16-token completion on tiny-llama, p50 <= 300 ms on a 2-core box.

Usage: .venv/bin/python bench/chat_bench.py [--requests 50] [--max-tokens 16] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_bench import Service, summary_ms, write_report

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def wait_inference_ready(svc: Service, timeout: float = 300.0) -> None:
    log = svc.data_dir / "logs" / "inference.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and b" ready on queue " in log.read_bytes():
            return
        time.sleep(0.2)
    raise RuntimeError("the inference worker was not ready in time")


def non_streamed(c: httpx.Client, body: dict[str, Any], n: int) -> tuple[list[float], list[int]]:
    latencies, tokens = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        r = c.post("/chat/completions", json=body)
        latencies.append(time.perf_counter() - t0)
        r.raise_for_status()
        tokens.append(int(r.json()["usage"]["completion_tokens"]))
    return latencies, tokens


def first_chunk(c: httpx.Client, body: dict[str, Any], n: int) -> list[float]:
    """Seconds to the first chunk carrying content (not the empty role chunk)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        first = None
        with c.stream("POST", "/chat/completions", json={**body, "stream": True}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and '"content":"' in line and '"content":""' not in line:
                    first = time.perf_counter() - t0
        out.append(first if first is not None else time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--note", default="", help="free text stored with the results (what was going on)")
    args = ap.parse_args()
    args.database_url = None  # write_report records the database; `loraq up` uses SQLite here

    with tempfile.TemporaryDirectory(prefix="loraq-chat-bench-") as tmp:
        svc = Service(Path(tmp) / "var", {"LORAQ_INFERENCE_METRICS_PORT": "0"})
        try:
            svc.wait_ready()
            wait_inference_ready(svc)
            c = httpx.Client(
                base_url=svc.url + "/v1", headers={"Authorization": f"Bearer {svc.key}"}, timeout=60
            )
            body = {"model": args.model, "messages": PROMPT, "max_tokens": args.max_tokens, "temperature": 0}
            non_streamed(c, body, args.warmup)
            load_before = os.getloadavg()[0]
            latencies, tokens = non_streamed(c, body, args.requests)
            ttft = first_chunk(c, body, args.requests)
            load_after = os.getloadavg()[0]
            c.close()
        finally:
            svc.stop()

    completion = summary_ms(latencies)
    results = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "completion_tokens": {"min": min(tokens), "max": max(tokens)},
        "non_streamed_latency": completion,
        "streamed_time_to_first_content": summary_ms(ttft),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(load_after, 2),
    }
    targets = {"non_streamed_p50_at_most_300ms": completion["p50_ms"] <= 300}
    write_report("chat", args, {"results": results, "targets_met": targets})
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
