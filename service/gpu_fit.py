"""Which GPU a training step fits, by the engine's memory plan (worker/engine/memory_plan.py).

`Step` is what the plan needs of a job: the model's dims, the base's storage, LoRA's rank and
targets, and the rows of `seq` tokens one GPU runs per micro-batch. `Step.plan(gpu_bytes)` is the
plan the worker makes on a GPU of that size (without offload: the captured GPU step, which most
runs take, keeps its saved tensors on the GPU), so the submit check, the dry run and the catalog
all predict with the one plan.

`COMMON_GPUS` are the sizes the catalog states: a base's `min_gpu` per precision is the first of
them its default job (service defaults: LoRA r and targets, `AUTO_BATCH_SIZE` rows of the default
`max_seq_len`) fits, split into micro-batches and checkpointed as the plan would. Each size's bytes
are the smallest total memory the cards named report (nvidia-smi `memory.total`, what workers
register), since the plan keeps the peak under 90 % of exactly that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.engine.catalog import PRETRAINED
from worker.engine.memory_plan import GGUF_BITS, GIB, MemoryPlan, ModelDims, catalog_dims, plan_memory
from worker.engine.training_config import AUTO_BATCH_SIZE, LoraConfig, TrainingOptions

MIB = 2**20


@dataclass(frozen=True)
class Gpu:
    memory_gb: int  # as the cards are sold
    cards: str  # "RTX 4090 / L4"
    memory_bytes: int  # the smallest memory.total of those cards

    @property
    def label(self) -> str:
        return f"{self.memory_gb} GB ({self.cards})"


H100 = Gpu(80, "A100 / H100", 81559 * MIB)
COMMON_GPUS: tuple[Gpu, ...] = (
    Gpu(8, "RTX 4060 / 3070", 8188 * MIB),
    Gpu(12, "RTX 3060 / 4070", 12282 * MIB),
    Gpu(16, "T4 / V100", 15360 * MIB),
    Gpu(24, "RTX 4090 / L4", 23034 * MIB),
    Gpu(40, "A100 40GB", 40960 * MIB),
    Gpu(48, "L40S / RTX A6000", 46068 * MIB),
    H100,
    Gpu(141, "H200", 143771 * MIB),
)
# the GPU of each worker class with a training benchmark (service/estimates.py's tables)
CLASS_GPUS: dict[str, Gpu] = {"h100": H100}

# the base's storage by the name the catalog lists it under: "bf16" is the unset `quantization`
PRECISIONS: dict[str, str | None] = {"bf16": None, "nf4": "nf4", "int8": "int8", "gguf": "gguf"}


def gguf_bits(model: str, quantization: str | None) -> float | None:
    """Bits a weight of a GGUF base kept as its file's blocks (its file name says the block type:
    X.Q4_1.gguf); None otherwise."""
    if quantization != "gguf" or model not in PRETRAINED:
        return None
    return GGUF_BITS.get(PRETRAINED[model].filename.split(".")[-2])


@dataclass(frozen=True)
class Step:
    """One GPU's share of a job's micro-batch: `rows` rows of `seq` tokens."""

    dims: ModelDims
    rank: int
    targets: tuple[str, ...] | str  # "all-linear" or module names
    rows: int
    seq: int
    quantization: str | None = None
    gguf_bits: float | None = None
    dropout: float = 0.0  # the LoRA input's

    def plan(self, gpu_bytes: int) -> MemoryPlan:
        return plan_memory(
            self.dims,
            rank=self.rank,
            targets=self.targets if isinstance(self.targets, str) else list(self.targets),
            rows=self.rows,
            seq=self.seq,
            gpu_bytes=gpu_bytes,
            quantization=self.quantization,
            gguf_bits=self.gguf_bits,
            allow_offload=False,
            dropout=self.dropout,
        )


def job_step(
    model: str,
    store: Path,
    *,
    rank: int,
    targets: list[str] | str,
    rows: int,
    seq: int,
    quantization: str | None,
    dropout: float = 0.0,
) -> Step | None:
    """The Step of a job on catalog model `model`; None where its dims cannot be read."""
    dims = catalog_dims(model, store)
    if dims is None:
        return None
    return Step(
        dims,
        rank,
        targets if isinstance(targets, str) else tuple(targets),
        rows,
        seq,
        quantization,
        gguf_bits(model, quantization),
        dropout,
    )


def precisions(model: str) -> list[str]:
    """The precisions a job on `model` may pick: gguf only for a GGUF base."""
    return [p for p in PRECISIONS if p != "gguf" or model in PRETRAINED]


def default_step(model: str, store: Path, precision: str) -> Step | None:
    """The Step of a job on `model` with every setting left to the service, in `precision`."""
    lora = LoraConfig()
    return job_step(
        model,
        store,
        rank=lora.r,
        targets=lora.target_modules,
        rows=AUTO_BATCH_SIZE,
        seq=TrainingOptions.model_fields["max_seq_len"].default,
        quantization=PRECISIONS[precision],
    )


@dataclass(frozen=True)
class MinGpu:
    gpu: Gpu | None  # None: it fits none of COMMON_GPUS
    plan: MemoryPlan  # on that GPU, or on the largest where none fits


@functools.lru_cache(maxsize=256)
def min_gpu(step: Step) -> MinGpu:
    """The smallest of COMMON_GPUS the step fits (a plan that fits a GPU fits every larger one)."""
    plan = None
    for gpu in COMMON_GPUS:
        plan = step.plan(gpu.memory_bytes)
        if plan.fits:
            return MinGpu(gpu, plan)
    assert plan is not None
    return MinGpu(None, plan)


def plan_fields(gpu_bytes: int, plan: MemoryPlan) -> dict[str, Any]:
    """A plan on a GPU of `gpu_bytes` as the API shows it (schemas.PlanPublic's fields)."""
    return {
        "gpu_memory_gib": round(gpu_bytes / GIB, 1),
        "fits": plan.fits,
        "predicted_peak_gib": round(plan.peak_bytes / GIB, 2),
        "limit_gib": round(plan.limit_bytes / GIB, 2),
        "micro_batch_rows": plan.choice.micro_rows,
        "activation_checkpointing": plan.choice.checkpointing,
        "offload_activations": plan.choice.offload,
        "plan": plan.sentence(),
    }


def catalog_min_gpus(model: str, store: Path) -> dict[str, dict[str, Any]] | None:
    """{precision: the smallest common GPU of `model`'s default job, its label and plan} (the
    /v1/models `min_gpu` field); None where the model's dims cannot be read."""
    out: dict[str, dict[str, Any]] = {}
    for precision in precisions(model):
        step = default_step(model, store, precision)
        if step is None:
            return None
        found = min_gpu(step)
        largest = COMMON_GPUS[-1]
        out[precision] = {
            "memory_gb": found.gpu.memory_gb if found.gpu else None,
            "gpu": found.gpu.label if found.gpu else f"none: more than {largest.label}",
            "plan": plan_fields((found.gpu or largest).memory_bytes, found.plan),
        }
    return out


def min_gpu_words(model: str, store: Path) -> str:
    """`catalog_min_gpus` in a line: "bf16 24 GB, nf4 12 GB, int8 12 GB" ("?": shape not known)."""
    found = catalog_min_gpus(model, store)
    if found is None:
        return "?"
    return ", ".join(f"{p} {f['memory_gb']} GB" if f["memory_gb"] else f"{p} none" for p, f in found.items())
