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

A model with no row of its own (any family: a Hub model, a local directory) is scaled from the
row nearest in parameters, within SCALE_LIMIT× of it (N parameters, W = hidden_size × layers):

    tokens per second  = the row's · N_row / N          (a token's training FLOPs ≈ 6 N)
    weights            = N × 2 bytes
    activations/token  = the row's · W / W_row

and says so in `basis`. A row of the model's own family (`FAMILY_TABLES`: the real shapes of
bench/family_shapes.py, random weights, measured by `train_bench.py --job --presets ...`) is taken
first; else the nearest Llama row, and the `basis` says that what the family adds to the step (q/k
norms, sandwich norms, windows, a larger vocabulary's logits) is not measured.

Pure Python: the API computes these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
TABLES: dict[str, dict[str, BenchRow]] = {
    "h100": {
        "smollm2-135m": BenchRow(
            "train-h100-2026-11-23-smollm2-135m-epilogue-peft-loraq.json", 8, 1024, 276601, 4.57
        ),
        "llama-1b": BenchRow("train-h100-2026-11-23-llama-1b-epilogue.json", 4, 2048, 81930, 12.4),
        "llama-8b": BenchRow("train-h100-2026-11-23-llama-8b-epilogue.json", 2, 2048, 16215, 33.24),
    },
}  # fmt: skip
SHAPE_OF = SHAPE_OF_PRETRAINED


@dataclass(frozen=True)
class FamilyRow:
    """A benchmark row of one family's published shape (bench/family_shapes.py), with the shape's
    figures the scaling needs (the service cannot import bench/)."""

    architecture: str
    parameters: int
    width_depth: int  # hidden_size × layers
    row: BenchRow


FAMILIES_FILE = "families-h100-2026-11-27.json"


def _measured(
    architecture: str, parameters: int, width_depth: int, rows: int, tok_s: int, gib: float
) -> FamilyRow:
    """A FAMILIES_FILE row: `rows` rows of 2,048 tokens a step."""
    return FamilyRow(architecture, parameters, width_depth, BenchRow(FAMILIES_FILE, rows, 2048, tok_s, gib))


# worker class -> family shape name -> row (the job path, packed, on the long-tail chat set)
FAMILY_TABLES: dict[str, dict[str, FamilyRow]] = {
    "h100": {
        "llama-3.1-8b": _measured("LlamaForCausalLM", 8030261248, 131072, 2, 16856, 32.93),
        "qwen3-8b": _measured("Qwen3ForCausalLM", 8190735360, 147456, 2, 16597, 35.36),
        "mistral-7b": _measured("MistralForCausalLM", 7241732096, 131072, 2, 17433, 31.47),
        "gemma-3-4b": _measured("Gemma3ForCausalLM", 3880263168, 87040, 2, 29379, 22.59),
        "phi-4-mini": _measured("Phi3ForCausalLM", 3836021760, 98304, 2, 29766, 18.76),
        "llama-3.2-1b": _measured("LlamaForCausalLM", 1235814400, 32768, 4, 88926, 12.13),
        "qwen3-1.7b": _measured("Qwen3ForCausalLM", 1720574976, 57344, 4, 60170, 19.58),
        "gemma-3-1b": _measured("Gemma3ForCausalLM", 999885952, 29952, 4, 95933, 15.03),
    },
}  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    worker_class: str
    peak_gpu_memory_gib: float | None  # None: no estimate, `unavailable` says why
    wall_seconds: float | None
    source: str | None
    unavailable: str | None = None
    basis: str | None = None  # how a figure was had from a row of another model (None: its own row)


def worker_classes(queue: str) -> list[str]:
    """The classes a plan reports on: every class with a benchmark table, and the job's own."""
    return sorted({*TABLES, queue})


def estimates(
    model: str,
    *,
    trained_tokens: int,
    batch_size: int,
    longest_row: int,
    queue: str,
    shape: ModelShape | None = None,
) -> list[Estimate]:
    """One entry per class of `worker_classes(queue)`: an estimate where the class has a benchmark
    row for `model`'s shape, or one to scale from to `shape` (the model's, from the catalog), else
    no figures and the reason (a user should not read a missing class as "fits anywhere")."""
    preset = SHAPE_OF.get(model, model)
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
        elif preset in rows:
            out.append(
                _from_row(worker_class, rows[preset], preset, trained_tokens, batch_size * longest_row)
            )
        elif (own := _nearest_family_row(worker_class, shape)) is not None:
            assert shape is not None
            name, family_row = own
            out.append(
                _scaled(
                    worker_class,
                    f"{name} row ({family_row.parameters / 1e9:.3g}B parameters, {shape.family.name})",
                    family_row.row,
                    (family_row.parameters, family_row.width_depth),
                    shape,
                    trained_tokens,
                    batch_size * longest_row,
                )
            )
        else:
            nearest = _nearest_row(rows, shape)
            if nearest is None:
                there = ", ".join(rows)
                near = (
                    f"; none within {SCALE_LIMIT:g}× of its {shape.parameters} parameters to scale from"
                    if shape is not None and shape.parameters
                    else ""
                )
                out.append(
                    _unavailable(
                        worker_class,
                        f"no training benchmark of {model} on {worker_class} "
                        f"(benchmarked there: {there}){near}",
                    )
                )
            else:
                assert shape is not None
                measured = PRESET_SHAPES[nearest]
                params = measured.parameter_count()
                label = f"{nearest} row ({params / 1e9:.3g}B parameters, Llama)"
                basis_shape = (params, measured.hidden_size * measured.num_hidden_layers)
                out.append(
                    _scaled(
                        worker_class,
                        label,
                        rows[nearest],
                        basis_shape,
                        shape,
                        trained_tokens,
                        batch_size * longest_row,
                        unmeasured_family=shape.family.architecture != LLAMA.architecture,
                    )
                )
    return out


def _nearest_row(rows: dict[str, BenchRow], shape: ModelShape | None) -> str | None:
    """The row's preset nearest `shape` in parameters (log scale), if within SCALE_LIMIT×."""
    if shape is None or not shape.parameters or not shape.width_depth:
        return None
    distance = {p: abs(math.log(PRESET_SHAPES[p].parameter_count() / shape.parameters)) for p in rows}
    best = min(distance, key=lambda p: distance[p])
    return best if distance[best] <= math.log(SCALE_LIMIT) else None


def _nearest_family_row(worker_class: str, shape: ModelShape | None) -> tuple[str, FamilyRow] | None:
    """The benchmark row of `shape`'s own family nearest it in parameters, within SCALE_LIMIT×."""
    if shape is None or not shape.parameters or not shape.width_depth:
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
    worker_class: str,
    label: str,
    row: BenchRow,
    measured: tuple[int, int],
    shape: ModelShape,
    trained_tokens: int,
    step_tokens: int,
    *,
    unmeasured_family: bool = False,
) -> Estimate:
    """`row`, measured on a model of `measured` = (parameters, hidden size × layers), scaled to a
    model of `shape` as the module docstring says."""
    assert shape.parameters is not None and shape.width_depth is not None
    row_params, row_width_depth = measured
    row_weights = row_params * 2 / GIB
    per_token = max(row.mem_gib - row_weights, 0.0) / (row.batch * row.seq)
    per_token *= shape.width_depth / row_width_depth
    tokens_per_s = row.tokens_per_s * row_params / shape.parameters
    basis = (
        f"scaled from the {label} to {shape.parameters / 1e9:.3g}B parameters by parameters and "
        "hidden size × layers"
    )
    if unmeasured_family:
        basis += f"; no {shape.family.name} row yet: what the family adds to Llama's step is not measured"
    return Estimate(
        worker_class=worker_class,
        peak_gpu_memory_gib=round(shape.parameters * 2 / GIB + per_token * step_tokens, 2),
        wall_seconds=round(trained_tokens / tokens_per_s, 1),
        source=f"bench/results/{row.source}",
        basis=basis,
    )


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
