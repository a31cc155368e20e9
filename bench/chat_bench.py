"""Chat completions benchmark: `loraq up` on this machine, one client on loopback.

Measures, with a warm idle inference worker (tiny-llama preloaded, a few warm-up requests):
- non-streamed completions of `--max-tokens` tokens (greedy), one at a time: wall latency
  p50/p99 from the client (HTTP, auth, model lookup, Redis both ways, decoding);
- streamed completions, one at a time: time to the first content chunk, p50/p99;
- `--concurrency` clients at once, each sending `--per-client` non-streamed completions, spread
  over the base model and `--adapters` fine-tuned tiny-llama adapters (trained first, a few
  seconds each): aggregate generated tokens/s against the same requests sent one at a time,
  which shows the worker batching rows of different adapters together.

Target: non-streamed 16-token completion on tiny-llama, p50 <= 300 ms on a 2-core box.

Usage: .venv/bin/python bench/chat_bench.py [--requests 50] [--max-tokens 16] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.service_bench import Service, summary_ms, write_report

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


def train_adapters(c: httpx.Client, n: int) -> list[str]:
    """`n` small tiny-llama jobs (different seeds and learning rates); their fine_tuned_model names."""
    line = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}]}
    data = "".join(json.dumps(line) + "\n" for _ in range(8)).encode()
    file_id = c.post("/files", data={"purpose": "fine-tune"}, files={"file": ("d.jsonl", data)}).json()["id"]
    ids = []
    for i in range(n):
        hp = {"n_epochs": 1, "batch_size": 4, "learning_rate_multiplier": 1 + i}
        body = {
            "model": "tiny-llama",
            "training_file": file_id,
            "seed": i,
            "suffix": f"a{i}",
            "hyperparameters": hp,
        }
        ids.append(c.post("/fine_tuning/jobs", json=body).json()["id"])
    models = []
    for job_id in ids:
        deadline = time.monotonic() + 300
        while (job := c.get(f"/fine_tuning/jobs/{job_id}").json())["status"] != "succeeded":
            if job["status"] in {"failed", "cancelled"} or time.monotonic() > deadline:
                raise RuntimeError(f"adapter job {job_id} ended {job['status']}: {job.get('error')}")
            time.sleep(0.2)
        models.append(job["fine_tuned_model"])
    return models


def mixed_load(c: httpx.Client, body: dict[str, Any], models: list[str], clients: int, per_client: int,
               concurrent: bool) -> dict[str, Any]:  # fmt: skip
    """Every client sends `per_client` requests, client i on models[i % len(models)]; all clients at
    once, or (concurrent=False) the same requests one after another."""
    jobs = [{**body, "model": models[i % len(models)]} for i in range(clients) for _ in range(per_client)]

    def one(request: dict[str, Any]) -> int:
        r = c.post("/chat/completions", json=request)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(clients) as pool:
            tokens = list(pool.map(one, jobs))
    else:
        tokens = [one(j) for j in jobs]
    seconds = time.perf_counter() - t0
    return {"requests": len(jobs), "tokens": sum(tokens), "seconds": round(seconds, 3),
            "tokens_per_s": round(sum(tokens) / seconds, 1)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--concurrency", type=int, default=8, help="clients at once in the mixed phase")
    ap.add_argument("--per-client", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=2, help="fine-tuned adapters in the mixed phase")
    ap.add_argument("--mixed-tokens", type=int, default=32, help="max_tokens of the mixed phase")
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
            models = [args.model, *train_adapters(c, args.adapters)]
            mixed_body = {**body, "max_tokens": args.mixed_tokens}
            mixed_load(c, mixed_body, models, len(models), 1, concurrent=False)  # adapters loaded: warm
            sequential = mixed_load(
                c, mixed_body, models, args.concurrency, args.per_client, concurrent=False
            )
            concurrent = mixed_load(c, mixed_body, models, args.concurrency, args.per_client, concurrent=True)
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
        "mixed_adapters": {
            "models": len(models),
            "clients": args.concurrency,
            "max_tokens": args.mixed_tokens,
            "one_at_a_time": sequential,
            "concurrent": concurrent,
            "speedup": round(concurrent["tokens_per_s"] / sequential["tokens_per_s"], 2),
        },
    }
    targets = {"non_streamed_p50_at_most_300ms": completion["p50_ms"] <= 300}
    write_report("chat", args, {"results": results, "targets_met": targets})
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
