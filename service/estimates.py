"""Pre-flight estimates of a job's peak GPU memory and wall time, from the benchmark tables.

Each worker class has rows measured by `bench/train_bench.py` (Loraq's own train step, LoRA r=16
on every linear layer, bf16 base) and committed under bench/results/; `TABLES` copies the figures
this module needs and names the file each comes from (tests/service/test_estimates.py checks they
still match). From a row measured at `batch × seq` tokens per step:

    wall time  = trained tokens / the row's tokens per second
    peak GiB   = weights + (row GiB − weights) · (job tokens per step / row tokens per step)

where weights = parameters × 2 bytes (bf16) and a job's tokens per step is its batch size times
its longest training row (a batch of the longest rows: the worst step). Activations grow about
linearly with the tokens of a step; other ranks than 16 change the figures little (the adapters
are a fraction of a percent of the weights). A model without a row on a class has no estimate.

Pure Python: the API computes these.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.catalog import PRESET_SHAPES

GIB = 2**30


@dataclass(frozen=True)
class BenchRow:
    source: str  # the result file under bench/results/
    batch: int
    seq: int
    tokens_per_s: float
    mem_gib: float


# worker class -> benchmark shape name -> row. The pulled smollm2-135m-instruct has the shape (and
# the speed) of the `smollm2-135m` preset.
TABLES: dict[str, dict[str, BenchRow]] = {
    "h100": {
        "smollm2-135m": BenchRow(
            "train-h100-2026-11-23-smollm2-135m-epilogue-peft-loraq.json", 8, 1024, 276601, 4.57
        ),
        "llama-1b": BenchRow("train-h100-2026-11-23-llama-1b-epilogue.json", 4, 2048, 81930, 12.4),
        "llama-8b": BenchRow("train-h100-2026-11-23-llama-8b-epilogue.json", 2, 2048, 16215, 33.24),
    },
}  # fmt: skip
SHAPE_OF = {"smollm2-135m-instruct": "smollm2-135m"}


@dataclass(frozen=True)
class Estimate:
    worker_class: str
    peak_gpu_memory_gib: float
    wall_seconds: float
    source: str


def estimates(model: str, *, trained_tokens: int, batch_size: int, longest_row: int) -> list[Estimate]:
    """One estimate per worker class that has a benchmark row for `model`'s shape."""
    shape = SHAPE_OF.get(model, model)
    out = []
    for worker_class, rows in TABLES.items():
        row = rows.get(shape)
        if row is None or shape not in PRESET_SHAPES:
            continue
        weights = PRESET_SHAPES[shape].parameter_count() * 2 / GIB
        per_token = max(row.mem_gib - weights, 0.0) / (row.batch * row.seq)
        peak = weights + per_token * batch_size * longest_row
        out.append(
            Estimate(
                worker_class=worker_class,
                peak_gpu_memory_gib=round(peak, 2),
                wall_seconds=round(trained_tokens / row.tokens_per_s, 1),
                source=f"bench/results/{row.source}",
            )
        )
    return out
