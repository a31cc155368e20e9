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
are a fraction of a percent of the weights). A class without a row for the model (tiny-llama on
h100, any model on a class never benchmarked, such as the job's own `cpu` or `default` queue) gets
an entry without figures that says so.

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
    peak_gpu_memory_gib: float | None  # None: no estimate, `unavailable` says why
    wall_seconds: float | None
    source: str | None
    unavailable: str | None = None


def worker_classes(queue: str) -> list[str]:
    """The classes a plan reports on: every class with a benchmark table, and the job's own."""
    return sorted({*TABLES, queue})


def estimates(
    model: str, *, trained_tokens: int, batch_size: int, longest_row: int, queue: str
) -> list[Estimate]:
    """One entry per class of `worker_classes(queue)`: an estimate where the class has a benchmark
    row for `model`'s shape, else no figures and the reason (a user should not read a missing
    class as "fits anywhere")."""
    shape = SHAPE_OF.get(model, model)
    out = []
    for worker_class in worker_classes(queue):
        rows = TABLES.get(worker_class)
        if rows is None:
            benchmarked = ", ".join(sorted(TABLES))
            out.append(
                _unavailable(
                    worker_class,
                    f"no training benchmark for worker class {worker_class!r} "
                    f"(bench/results has them for: {benchmarked})",
                )
            )
        elif shape not in rows:
            there = ", ".join(rows)
            out.append(
                _unavailable(
                    worker_class,
                    f"no training benchmark of {model} on {worker_class} (benchmarked there: {there})",
                )
            )
        else:
            out.append(_from_row(worker_class, rows[shape], shape, trained_tokens, batch_size * longest_row))
    return out


def _unavailable(worker_class: str, why: str) -> Estimate:
    return Estimate(worker_class, None, None, None, unavailable=why)


def _from_row(
    worker_class: str, row: BenchRow, shape: str, trained_tokens: int, step_tokens: int
) -> Estimate:
    """Scale the row measured at `row.batch × row.seq` tokens a step to a step of `step_tokens`."""
    weights = PRESET_SHAPES[shape].parameter_count() * 2 / GIB  # every table row is a preset's
    per_token = max(row.mem_gib - weights, 0.0) / (row.batch * row.seq)
    return Estimate(
        worker_class=worker_class,
        peak_gpu_memory_gib=round(weights + per_token * step_tokens, 2),
        wall_seconds=round(trained_tokens / row.tokens_per_s, 1),
        source=f"bench/results/{row.source}",
    )
