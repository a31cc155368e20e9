"""Where the job path's step time and peak memory go, next to the fixed-shape captured step.

For one model, in one process each (`--part job` / `--part fixed`, run by the default `--part
both` as subprocesses), on a CUDA host:

- job: `recipe.train` as `train_bench.py --job` runs it (job_bench.job_cell's settings). CUDA
  events around every graph replay give each step's GPU time and the GPU's idle time between
  one replay's end and the next one's start (host work the GPU waits for); cProfile covers the
  host side of the timed steps (top functions by own time).
- both: the allocator's history (torch.cuda.memory._record_memory_history) replayed to the
  moment of peak allocation; the blocks alive then, grouped by the innermost frame of this repo
  that allocated them, so the job's and the fixed step's peaks can be compared line by line.

- kernels (`--part kernels`, run on its own): one step of the job, as the graph replays it and
  as the same step function runs eagerly, under torch.profiler; every CUDA kernel's time and
  count, summed by kind (GEMM, attention forward / backward, LoRA, cross-entropy, norms, ...),
  so the step's time can be set against the per-step floor (GEMMs + attention + lm_head).

Usage: python bench/job_profile.py --preset smollm2-135m [--steps 20] --out DIR
Writes DIR/job-profile-<preset>.json (`--part kernels`: DIR/job-kernels-<preset>.json).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.job_bench import JOB_SHAPES, JOB_WARMUP, StepCollector, family_base, job_config, job_shape  # noqa: E402

REPO_DIRS = ("/worker/", "/gpu_kernels/", "/bench/", "/service/")


def _frame_key(frames: list[dict[str, Any]]) -> str:
    """The innermost frame in this repo (else the innermost frame) as file:line name."""
    for f in frames:
        name = str(f.get("filename", ""))
        if any(d in name for d in REPO_DIRS) and "job_profile" not in name:
            return f"{name.split('/main/')[-1].split('/p/')[-1]}:{f.get('line')} {f.get('name')}"
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"
    return "?"


def peak_breakdown(top: int = 25) -> dict[str, Any]:
    """Replay the recorded allocator history: the peak of allocated bytes and what was alive then."""
    import torch

    snap = torch.cuda.memory._snapshot()
    trace = snap["device_traces"][0] if snap["device_traces"] else []
    cur = peak = 0
    peak_at = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            cur += ev["size"]
        elif ev["action"] == "free_requested":
            cur -= ev["size"]
        if cur > peak:
            peak, peak_at = cur, i
    live: dict[int, tuple[int, str]] = {}
    for ev in trace[: peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _frame_key(ev.get("frames", [])))
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    groups: dict[str, list[int]] = {}
    for size, key in live.values():
        g = groups.setdefault(key, [0, 0])
        g[0] += size
        g[1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    return {
        "trace_events": len(trace),
        "peak_bytes_in_trace": peak,
        "peak_event_index": peak_at,
        "live_at_peak": [{"where": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]],
        "live_at_peak_all": {k: v[0] for k, v in ranked},
    }


def part_job(preset: str, steps: int, batch_rows: int | None = None) -> dict[str, Any]:
    import torch

    from worker.engine import train_step as ts_mod
    from worker.engine.recipe import train

    batch, seq, _, _ = JOB_SHAPES[preset]
    batch = batch_rows or batch
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    events: list[tuple[Any, Any, float]] = []
    orig_run = ts_mod.CapturedTrainStep.run

    def timed_run(self: Any) -> Any:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        start.record()
        out = orig_run(self)
        end.record()
        events.append((start, end, t))
        return out

    ts_mod.CapturedTrainStep.run = timed_run  # type: ignore[method-assign]
    prof = cProfile.Profile()
    marks: dict[str, int] = {}

    class Collector:
        def on_step(self, m: Any) -> None:
            if m.step == JOB_WARMUP:
                prof.enable()
            if m.step == JOB_WARMUP + steps:
                prof.disable()
            marks.setdefault("peak_after_step_" + str(m.step), torch.cuda.max_memory_allocated())

        def on_event(self, level: str, message: str, data: Any = None) -> None:
            return None

        def on_checkpoint(self, c: Any) -> None:
            marks[f"peak_after_checkpoint_{len(marks)}"] = torch.cuda.max_memory_allocated()

        def should_stop(self) -> bool:
            return False

    config = job_config(preset, batch, seq, steps, Path(tempfile.mkdtemp()))
    torch.cuda.reset_peak_memory_stats()
    train(config, Collector())
    torch.cuda.synchronize()
    rows = []
    for i, (s, e, t) in enumerate(events):
        row = {"gpu_ms": round(s.elapsed_time(e), 3)}
        if i + 1 < len(events):
            row["gpu_idle_after_ms"] = round(e.elapsed_time(events[i + 1][0]), 3)
            row["host_ms"] = round(1e3 * (events[i + 1][2] - t), 3)
        rows.append(row)
    timed = rows[-steps:-1]
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
    return {
        "part": "job",
        "batch": batch,
        "seq": seq,
        "replays": len(events),
        "steps": rows,
        "timed_mean": {
            k: round(sum(r[k] for r in timed) / len(timed), 3)
            for k in ("gpu_ms", "gpu_idle_after_ms", "host_ms")
        },
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "peak_marks": marks,
        "memory": peak_breakdown(),
        "host_profile": out.getvalue()[-6000:],
    }


# kernel name patterns (lower case, first match wins) → kind
KERNEL_KINDS = (
    ("flash_fwd", "attention forward"),
    ("flash_bwd", "attention backward"),
    ("cudnn", "attention (cuDNN)"),
    ("fmha", "attention (cuDNN)"),
    ("cross_entropy", "cross-entropy"),
    ("ce_fwd_bwd", "cross-entropy"),
    ("glu_bwd_lora", "MLP backward with its LoRA (fused)"),
    ("rank_update", "LoRA kernels"),
    ("dropout", "LoRA kernels"),
    ("rms", "norms"),
    ("swiglu", "SwiGLU"),
    ("rope", "rope"),
    ("clip", "clip"),
    ("nonfinite", "clip"),
    ("multi_tensor", "optimizer"),
    ("adam", "optimizer"),
    ("gemm", "GEMM"),
    ("xmma", "GEMM"),
    ("cutlass", "GEMM"),
    ("nvjet", "GEMM"),
    ("splitk", "GEMM"),
    ("reduce", "reductions"),
    ("index", "gather / scatter"),
    ("scatter", "gather / scatter"),
    ("gather", "gather / scatter"),
    ("memcpy", "copies"),
    ("memset", "copies"),
    ("elementwise", "elementwise"),
    ("vectorized", "elementwise"),
    ("unrolled", "elementwise"),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for pattern, kind in KERNEL_KINDS if pattern in low), "other")


def kernel_table(prof: Any, top: int = 40) -> dict[str, Any]:
    """The profiled CUDA kernels: total ms by kind, and the `top` kernels by time."""
    from torch.autograd import DeviceType

    rows = [
        (e.key, e.count, e.self_device_time_total / 1e3)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
    ]
    kinds: dict[str, list[float]] = {}
    for name, count, ms in rows:
        k = kinds.setdefault(kernel_kind(name), [0.0, 0])
        k[0] += ms
        k[1] += count
    rows.sort(key=lambda r: -r[2])
    ranked = sorted(kinds.items(), key=lambda kv: -kv[1][0])
    return {
        "total_ms": round(sum(r[2] for r in rows), 3),
        "by_kind": {k: {"ms": round(v[0], 3), "kernels": int(v[1])} for k, v in ranked},
        "top": [
            {"name": n[:160], "count": c, "ms": round(ms, 4), "kind": kernel_kind(n)}
            for n, c, ms in rows[:top]
        ],
    }


def part_kernels(preset: str, steps: int, batch_rows: int | None = None) -> dict[str, Any]:
    """Profile one replay of the job's captured step and one eager run of its step function,
    taken mid-run from inside recipe.train (the buffers hold a real packed step then)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from worker.engine import train_step as ts_mod
    from worker.engine.recipe import train

    shape = job_shape(preset)  # a catalog preset or a family shape
    assert shape is not None, preset
    batch, seq, _, _ = shape
    batch = batch_rows or batch
    seen: dict[str, Any] = {}
    orig_run = ts_mod.CapturedTrainStep.run

    def run(self: Any) -> Any:
        seen["step"] = self
        return orig_run(self)

    ts_mod.CapturedTrainStep.run = run  # type: ignore[method-assign]
    report: dict[str, Any] = {"part": "kernels", "batch": batch, "seq": seq}
    at = JOB_WARMUP + 2

    def measure() -> None:
        ts = seen["step"]
        torch.cuda.synchronize()
        runs = [("eager", ts.graphed.step_fn)]
        if ts.graphed.captured:
            runs.insert(0, ("replay", ts.graphed.graph.replay))
        for label, fn in runs:
            try:
                fn()  # once unprofiled: the eager run's allocations settle
            except torch.OutOfMemoryError:  # the eager step beside the graph's pool (8B at 4 rows)
                torch.cuda.empty_cache()
                report[label] = {"skipped": "out of memory beside the captured step's memory pool"}
                continue
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
            report[label] = {"step_ms": round(start.elapsed_time(end), 3), **kernel_table(prof)}
        report["shape"] = ts.shape.__dict__ if ts.shape is not None else None

    class Collector(StepCollector):
        def on_step(self, m: Any) -> None:
            super().on_step(m)
            if m.step == at:
                measure()

    config = job_config(preset, batch, seq, max(steps, 4), Path(tempfile.mkdtemp()))
    train(config, Collector(), loaded=family_base(preset))
    return report


def part_fixed(preset: str, steps: int) -> dict[str, Any]:
    import torch

    from bench.train_bench import _loraq_step

    batch, seq, _, _ = JOB_SHAPES[preset]
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    info: dict[str, Any] = {}
    step, _ = _loraq_step(preset, batch, seq, info)
    at_reset = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(7 + steps):
        step()
    torch.cuda.synchronize()
    return {
        "part": "fixed",
        "batch": batch,
        "seq": seq,
        "allocated_at_bench_reset": at_reset,
        "max_memory_allocated_as_benched": torch.cuda.max_memory_allocated(),
        "memory": peak_breakdown(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--part", choices=["both", "job", "fixed", "kernels"], default="both")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument(
        "--batch-size", type=int, help="with --part kernels or job: rows a step (default the preset's)"
    )
    a = ap.parse_args()
    if a.part == "kernels":
        kernels = {
            "preset": a.preset,
            "command": " ".join(sys.argv),
            **part_kernels(a.preset, a.steps, a.batch_size),
        }
        a.out.mkdir(parents=True, exist_ok=True)
        rows = f"-batch{a.batch_size}" if a.batch_size else ""
        (a.out / f"job-kernels-{a.preset}{rows}.json").write_text(json.dumps(kernels, indent=1))
        for label in ("replay", "eager"):
            if "step_ms" in kernels.get(label, {}):
                print(label, kernels[label]["step_ms"], "ms; kernels", kernels[label]["total_ms"], "ms")
                print(json.dumps(kernels[label]["by_kind"], indent=1))
        return
    if a.part != "both":
        result = (
            part_job(a.preset, a.steps, a.batch_size) if a.part == "job" else part_fixed(a.preset, a.steps)
        )
        print("RESULT " + json.dumps(result))
        return
    report: dict[str, Any] = {"preset": a.preset, "command": " ".join(sys.argv)}
    for part in ("job", "fixed"):
        proc = subprocess.run(
            [sys.executable, __file__, "--preset", a.preset, "--steps", str(a.steps), "--part", part],
            capture_output=True,
            text=True,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        report[part] = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-4000:]}
    job, fixed = report["job"], report["fixed"]
    if "memory" in job and "memory" in fixed:
        a_all, b_all = job["memory"]["live_at_peak_all"], fixed["memory"]["live_at_peak_all"]
        diff = {k: a_all.get(k, 0) - b_all.get(k, 0) for k in set(a_all) | set(b_all)}
        report["peak_diff_job_minus_fixed"] = sorted(
            ({"where": k, "bytes": v} for k, v in diff.items() if v), key=lambda d: -abs(d["bytes"])
        )[:30]
        for part_report in (job, fixed):
            part_report["memory"].pop("live_at_peak_all")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"job-profile-{a.preset}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("job", "fixed")}, indent=1)[:6000])
    print(
        json.dumps(job.get("timed_mean"), indent=1),
        job.get("max_memory_allocated"),
        fixed.get("max_memory_allocated_as_benched"),
    )
    print(job.get("host_profile", job.get("error", ""))[-4000:])
    print(fixed.get("error", ""))


if __name__ == "__main__":
    main()
