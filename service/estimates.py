"""Pre-flight estimates of a job's peak GPU memory and wall time on each benchmarked worker class.

Peak memory is the memory plan's (worker/engine/memory_plan.py, through service/gpu_fit.py): the
predicted peak of the job's step (its model's shape, the base's storage, LoRA's rank and targets,
the rows of one GPU's micro-batch) on the class's GPU (`CLASS_GPUS`: h100 is an 80 GB H100), split
into micro-batches and checkpointed as the worker will do there; `memory_plan` says how. It needs
no benchmark row of the model, only its shape.

Wall time comes from the benchmark tables: each worker class has rows measured by
`bench/train_bench.py` (Loraq's own train step, LoRA r=16 on every linear layer, bf16 base)
and committed under bench/results/; `TABLES` copies the figures this module needs and names the
file each comes from (tests/service/test_estimates.py checks they still match):

    wall time  = trained tokens / the row's tokens per second

A model with no row of its own (any family: a Hub model, a local directory) is scaled from the
row nearest in parameters, within SCALE_LIMIT× of it (N parameters):

    tokens per second  = the row's · N_row / N          (a token's training FLOPs ≈ 6 N)

and says so in `basis`. A row of the model's own family (`FAMILY_TABLES`: the real shapes of
bench/family_shapes.py, random weights, measured by `train_bench.py --job --presets ...`) is taken
first; else the nearest Llama row, and the `basis` says that what the family adds to the step (q/k
norms, sandwich norms, windows, a larger vocabulary's logits) is not measured. A class without a
row for the model (tiny-llama on h100) has a peak and no wall time; a class never benchmarked (the
job's own `cpu` or `default` queue) neither: its GPU is not known. `unavailable` says why.

Pure Python: the API computes these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from service.gpu_fit import CLASS_GPUS, Step, plan_fields

# the catalog's names (pure Python; the control plane imports from worker/ only the catalog)
from worker.engine.catalog import LLAMA, PRESET_SHAPES, SHAPE_OF_PRETRAINED, ModelShape

GIB = 2**30
SCALE_LIMIT = 4.0  # a row scales to models within this factor of its parameters, no further


@dataclass(frozen=True)
class BenchRow:
    source: str  # the result file under bench/results/
    batch: int
    seq: int
    tokens_per_s: float
    mem_gib: float


# worker class -> benchmark shape name -> row. The pulled smollm2-135m-instruct has the shape (and
# the speed) of the `smollm2-135m` preset.
JOB_PRESETS = "job-h100-2026-12-07-presets-norm-source.json"
TABLES: dict[str, dict[str, BenchRow]] = {
    "h100": {
        # the job path with the fused LoRA MLP and the LoRA ops keeping the norms' inputs (308c08f),
        # on the committed long-tail chat set
        "smollm2-135m": BenchRow(JOB_PRESETS, 4, 2048, 269884, 3.29),
        "llama-1b": BenchRow(JOB_PRESETS, 4, 2048, 90235, 9.32),
        "llama-8b": BenchRow(JOB_PRESETS, 2, 2048, 16957, 27.61),
    },
}  # fmt: skip
SHAPE_OF = SHAPE_OF_PRETRAINED


@dataclass(frozen=True)
class FamilyRow:
    """A benchmark row of one family's published shape (bench/family_shapes.py), with the shape's
    parameter count the scaling needs (the service cannot import bench/)."""

    architecture: str
    parameters: int
    row: BenchRow


# the rows measured with the fused LoRA MLP (gpu_kernels.ops.lora_mlp) and the LoRA ops keeping
# the norms' inputs (gpu_kernels/ops/norm_source.py), 308c08f
ONE_B = "families-h100-2026-12-07-1b-class-norm-source.json"
EIGHT_B = "families-h100-2026-12-07-8b-norm-source.json"
MID = "families-h100-2026-12-07-mid-norm-source.json"
TWELVE_B = "families-h100-2026-12-07-12b-norm-source.json"


def _measured(
    architecture: str, parameters: int, rows: int, tok_s: int, gib: float, source: str
) -> FamilyRow:
    """A row of `source`: `rows` rows of 2,048 tokens a step."""
    return FamilyRow(architecture, parameters, BenchRow(source, rows, 2048, tok_s, gib))


# worker class -> family shape name -> row (the job path, packed, on the long-tail chat set)
FAMILY_TABLES: dict[str, dict[str, FamilyRow]] = {
    "h100": {
        "llama-3.1-8b": _measured("LlamaForCausalLM", 8030261248, 2, 17100, 27.61, EIGHT_B),
        "qwen3-8b": _measured("Qwen3ForCausalLM", 8190735360, 2, 16710, 28.2, EIGHT_B),
        "mistral-7b": _measured("MistralForCausalLM", 7241732096, 2, 17612, 26.14, MID),
        "gemma-3-4b": _measured("Gemma3ForCausalLM", 3880263168, 2, 29743, 17.67, MID),
        "gemma-3-12b": _measured("Gemma3ForCausalLM", 11766034176, 1, 10208, 33.91, TWELVE_B),
        "phi-4-mini": _measured("Phi3ForCausalLM", 3836021760, 2, 30241, 15.38, MID),
        "llama-3.2-1b": _measured("LlamaForCausalLM", 1235814400, 4, 90428, 9.32, ONE_B),
        "qwen3-1.7b": _measured("Qwen3ForCausalLM", 1720574976, 4, 60659, 13.61, MID),
        "gemma-3-1b": _measured("Gemma3ForCausalLM", 999885952, 4, 97736, 10.95, ONE_B),
    },
}  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    worker_class: str
    peak_gpu_memory_gib: float | None  # the plan's predicted peak on the class's GPU
    wall_seconds: float | None
    source: str | None  # the benchmark result the wall time comes from
    unavailable: str | None = None  # why a figure is null
    basis: str | None = None  # how the wall time was had from a row of another model (None: its own row)
    memory_plan: dict[str, Any] | None = None  # schemas.PlanPublic's fields


@dataclass(frozen=True)
class Speed:
    """Where a class's tokens per second for the model come from."""

    tokens_per_s: float
    source: str
    basis: str | None = None


def worker_classes(queue: str) -> list[str]:
    """The classes a plan reports on: every class with a benchmark table, and the job's own."""
    return sorted({*TABLES, queue})


def estimates(
    model: str,
    *,
    trained_tokens: int,
    queue: str,
    step: Step | None,
    shape: ModelShape | None = None,
) -> list[Estimate]:
    """One entry per class of `worker_classes(queue)`: the peak of `step` (the job's step, None
    where the model's shape is not known) planned on the class's GPU, and the wall time from the
    class's benchmark row for `model`'s shape or one to scale from to `shape` (the model's, from
    the catalog); a figure that cannot be had is null and `unavailable` says why (a user should
    not read a missing class as "fits anywhere")."""
    out = []
    for worker_class in worker_classes(queue):
        rows = TABLES.get(worker_class)
        if rows is None:
            benchmarked = ", ".join(sorted(TABLES))
            why = (
                f"no training benchmark for worker class {worker_class!r} "
                f"(bench/results has them for: {benchmarked})"
            )
            out.append(Estimate(worker_class, None, None, None, unavailable=why))
            continue
        gpu = CLASS_GPUS[worker_class]
        plan = step.plan(gpu.memory_bytes) if step is not None else None
        speed, no_speed = _speed(worker_class, rows, model, shape)
        reasons = [] if plan is not None else [f"the shape of {model} is not known: no memory plan"]
        if speed is None:
            reasons.append(no_speed)
        out.append(
            Estimate(
                worker_class=worker_class,
                peak_gpu_memory_gib=round(plan.peak_bytes / GIB, 2) if plan else None,
                wall_seconds=round(trained_tokens / speed.tokens_per_s, 1) if speed else None,
                source=f"bench/results/{speed.source}" if speed else None,
                unavailable="; ".join(reasons) or None,
                basis=speed.basis if speed else None,
                memory_plan=plan_fields(gpu.memory_bytes, plan) if plan else None,
            )
        )
    return out


def _speed(
    worker_class: str, rows: dict[str, BenchRow], model: str, shape: ModelShape | None
) -> tuple[Speed | None, str]:
    """The class's tokens per second for `model`: its own row, else one of its family scaled, else
    the nearest Llama row scaled; (None, why) where none is near enough."""
    preset = SHAPE_OF.get(model, model)
    if preset in rows:
        return Speed(rows[preset].tokens_per_s, rows[preset].source), ""
    if (own := _nearest_family_row(worker_class, shape)) is not None:
        assert shape is not None
        name, family_row = own
        label = f"{name} row ({family_row.parameters / 1e9:.3g}B parameters, {shape.family.name})"
        return _scaled(label, family_row.row, family_row.parameters, shape), ""
    nearest = _nearest_row(rows, shape)
    if nearest is None:
        there = ", ".join(rows)
        near = (
            f"; none within {SCALE_LIMIT:g}× of its {shape.parameters} parameters to scale from"
            if shape is not None and shape.parameters
            else ""
        )
        return None, f"no training benchmark of {model} on {worker_class} (benchmarked there: {there}){near}"
    assert shape is not None
    params = PRESET_SHAPES[nearest].parameter_count()
    label = f"{nearest} row ({params / 1e9:.3g}B parameters, Llama)"
    unmeasured = shape.family.architecture != LLAMA.architecture
    return _scaled(label, rows[nearest], params, shape, unmeasured_family=unmeasured), ""


def _nearest_row(rows: dict[str, BenchRow], shape: ModelShape | None) -> str | None:
    """The row's preset nearest `shape` in parameters (log scale), if within SCALE_LIMIT×."""
    if shape is None or not shape.parameters:
        return None
    distance = {p: abs(math.log(PRESET_SHAPES[p].parameter_count() / shape.parameters)) for p in rows}
    best = min(distance, key=lambda p: distance[p])
    return best if distance[best] <= math.log(SCALE_LIMIT) else None


def _nearest_family_row(worker_class: str, shape: ModelShape | None) -> tuple[str, FamilyRow] | None:
    """The benchmark row of `shape`'s own family nearest it in parameters, within SCALE_LIMIT×."""
    if shape is None or not shape.parameters:
        return None
    own = {
        name: row
        for name, row in FAMILY_TABLES.get(worker_class, {}).items()
        if row.architecture == shape.family.architecture
    }
    if not own:
        return None
    params = shape.parameters
    distance = {name: abs(math.log(row.parameters / params)) for name, row in own.items()}
    best = min(distance, key=lambda name: distance[name])
    return (best, own[best]) if distance[best] <= math.log(SCALE_LIMIT) else None


def _scaled(
    label: str, row: BenchRow, row_params: int, shape: ModelShape, *, unmeasured_family: bool = False
) -> Speed:
    """`row`, measured on a model of `row_params` parameters, scaled to a model of `shape`."""
    assert shape.parameters is not None
    basis = (
        f"tokens per second scaled from the {label} to {shape.parameters / 1e9:.3g}B parameters "
        "by the parameter ratio"
    )
    if unmeasured_family:
        basis += f"; no {shape.family.name} row yet: what the family adds to Llama's step is not measured"
    return Speed(row.tokens_per_s * row_params / shape.parameters, row.source, basis)
