"""Why N GPUs that split a fixed global batch fall short of N×: each step waits for its slowest row.

Under `batch_scaling: "global"` with N rows a step on N GPUs, the GPUs of step k train rows N·k to
N·k + N − 1 of the sampler's order, one each, and a one-GPU job with one row a step
(`train_bench.py --job-cell <preset> job 1 2048 8 <steps>`, same data and seed) trains the same
rows in the same order, one a step. So
the N-GPU step k cannot take less than the slowest of its N rows alone, max_r t[N·k + r], however
fast the all-reduce: packed rows of a long-tail chat set differ in attention work (one 1,900-token
conversation against a dozen short ones), and that spread, not communication, is what the N-GPU
step pays. This script reads the one-row runs (every step's time) and an `--n-gpus N` result and
writes, per model: the one-row step's mean, spread and range; the N-GPU step predicted from the
rows alone (mean over steps of the slowest row); the measured N-GPU step; what is left for
communication and waiting (measured − predicted); and the ratio that would remain with none of it
(one-GPU N-row step ÷ predicted).

    python bench/straggler.py --multi bench/results/multi-gpu-x4-h100-2026-11-27.json \\
        --one-row one-row-llama-8b.json one-row-llama-1b.json --out straggler.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.job_bench import JOB_WARMUP  # the job bench's untimed steps


def straggler_reading(
    one_row_seconds: list[float],
    n_gpus: int,
    multi_seconds: list[float],
    one_gpu_step_ms: float,
    warmup: int = JOB_WARMUP,
) -> dict[str, Any]:
    """`one_row_seconds`: every step of the one-row run (at least n_gpus × len(multi_seconds));
    `multi_seconds`: every step of the N-GPU run; `one_gpu_step_ms`: the one-GPU N-row step.
    Steps before `warmup` (of the N-GPU run; n_gpus × as many one-row steps) are left out."""
    steps = len(multi_seconds)
    if len(one_row_seconds) < n_gpus * steps:
        raise ValueError(f"{len(one_row_seconds)} one-row steps cover fewer than {n_gpus} x {steps} rows")
    rows = [1e3 * t for t in one_row_seconds[n_gpus * warmup : n_gpus * steps]]
    slowest = [max(rows[i : i + n_gpus]) for i in range(0, len(rows), n_gpus)]
    measured = [1e3 * t for t in multi_seconds[warmup:]]
    predicted_ms = statistics.mean(slowest)
    measured_ms = statistics.mean(measured)
    return {
        "steps": len(measured),
        "one_row_step_ms": {
            "mean": round(statistics.mean(rows), 2),
            "sd": round(statistics.pstdev(rows), 2),
            "min": round(min(rows), 2),
            "max": round(max(rows), 2),
        },
        "one_gpu_step_ms_per_gpu": round(one_gpu_step_ms / n_gpus, 2),  # the N-row step ÷ N
        "predicted_step_ms_slowest_row": round(predicted_ms, 2),
        "measured_step_ms": round(measured_ms, 2),
        "communication_and_waiting_ms": round(measured_ms - predicted_ms, 2),
        "ratio_measured": round(one_gpu_step_ms / measured_ms, 3),
        "ratio_ceiling_without_communication": round(one_gpu_step_ms / predicted_ms, 3),
        "correlation_predicted_measured": (
            round(statistics.correlation(slowest, measured), 3) if len(measured) > 2 else None
        ),
    }


def split_reading(
    one_row_seconds: list[float], work: list[int], n_gpus: int, rows: int, warmup: int = JOB_WARMUP
) -> dict[str, Any]:
    """A global batch of `rows` rows on `n_gpus` GPUs, estimated from a one-row run: each rank's
    step as the sum of its rows' one-row times, over the run's steps after `warmup`, cut into
    batches of `rows`. `work`: each row's attention work in the one-row run's order
    (`row_work_in_order`). Returns the slowest rank's step over the mean rank's for the strided
    split (rank r: rows r, r + N, ...) and for the engine's split (`distributed.balanced_shards`),
    and how much shorter the engine's split makes the step."""
    from worker.engine.distributed import balanced_shards

    times, costs = one_row_seconds[warmup:], work[warmup : len(one_row_seconds)]
    strided: list[float] = []
    balanced: list[float] = []
    mean: list[float] = []
    for i in range(0, len(times) - rows + 1, rows):
        t, w = times[i : i + rows], costs[i : i + rows]
        strided.append(max(sum(t[r::n_gpus]) for r in range(n_gpus)))
        balanced.append(max(sum(t[j] for j in shard) for shard in balanced_shards(w, n_gpus)))
        mean.append(sum(t) / n_gpus)
    if not mean:
        raise ValueError(f"{len(times)} one-row steps after warm-up make no batch of {rows} rows")
    return {
        "n_gpus": n_gpus,
        "rows": rows,
        "batches": len(mean),
        "strided_slowest_over_mean": round(statistics.mean(strided) / statistics.mean(mean), 4),
        "balanced_slowest_over_mean": round(statistics.mean(balanced) / statistics.mean(mean), 4),
        "step_shorter_percent": round(100 * (1 - statistics.mean(balanced) / statistics.mean(strided)), 2),
        "correlation_work_time": round(statistics.correlation(times, [float(c) for c in costs]), 3),
    }


def row_work_in_order(seq: int = 2048) -> list[int]:
    """Attention work of each packed row of the long-tail chat set in the order a one-row job of
    the bench trains them (its sampler: seed 0, one row a batch, epoch 0 then 1, ...)."""
    from bench.job_bench import DATASET
    from worker.engine.data import BatchSampler, load_dataset
    from worker.engine.tiny import build_tiny_tokenizer

    data = load_dataset(DATASET, build_tiny_tokenizer(), seq, pack=True)
    sampler = BatchSampler(data, 1, seed=0)
    work = data.rows.attention_work()
    return [int(w) for epoch in range(4) for w in work[sampler.order_ids(epoch)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--multi", type=Path, required=True, help="a train_bench.py --job --n-gpus N result")
    ap.add_argument(
        "--one-row", type=Path, nargs="+", required=True, help="--job-cell rows (JSON), one per model"
    )
    ap.add_argument(
        "--split",
        default="",
        help="GPUS:ROWS[,GPUS:ROWS]: also estimate those global batches from the one-row runs, the "
        "strided split against the engine's (split_reading)",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    multi = json.loads(a.multi.read_text())
    n = int(multi["n_gpus"])
    by_variant = {(r["model"], r["variant"]): r for r in multi["rows"] if "error" not in r}
    readings: dict[str, Any] = {}
    one_rows: dict[str, Any] = {}
    for path in a.one_row:
        row = json.loads(path.read_text())
        model = row["model"]
        one_rows[model] = row
        one_gpu, split = by_variant[(model, "job")], by_variant[(model, f"job_x{n}")]
        readings[model] = straggler_reading(row["step_seconds"], n, split["step_seconds"], one_gpu["step_ms"])
    splits: dict[str, Any] = {}
    if a.split:
        work = row_work_in_order()
        for model, row in one_rows.items():
            splits[model] = [
                split_reading(row["step_seconds"], work, int(g), int(r))
                for g, r in (item.split(":") for item in a.split.split(","))
            ]
    result = {"multi_gpu_result": str(a.multi), "n_gpus": n, "readings": readings, "one_row_rows": one_rows}
    if splits:
        result["splits"] = splits
        print(json.dumps(splits, indent=1))
    print(json.dumps(readings, indent=1))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
