"""A job's memory plan against the live workers' GPUs, before any GPU is claimed.

Workers report each GPU's memory in their registry entry (`gpus`, service/worker_registry.py).
For the GPUs of the live workers that consume a job's Celery queue, `plans` runs the engine's
torch-free memory plan (worker/engine/memory_plan.py) for a micro-batch of the job's rows of
max_seq_len tokens; `check_fits` refuses at submit (400 `insufficient_gpu_memory`, naming what to
change) a job that fits none of them even split into 1-row micro-batches with full activation
checkpointing (offload is left out: the captured GPU step, which most runs take, cannot use it).
With no live GPU worker (CPU workers, or a registry that cannot be read) nothing is refused:
nothing is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.errors import InvalidRequestError
from service.gpu_fit import Step, job_step, plan_fields
from service.schemas import JobCreate
from service.settings import get_settings
from worker.engine.catalog import PRETRAINED
from worker.engine.memory_plan import MemoryPlan, refusal
from worker.engine.training_config import AUTO_BATCH_SIZE


@dataclass(frozen=True)
class GpuPlan:
    gpu_bytes: int  # one GPU's memory (the smallest of a worker's)
    workers: int  # live workers of the queue with GPUs this size
    plan: MemoryPlan


def queue_gpu_bytes(workers: list[dict[str, Any]], celery_queue: str) -> dict[int, int]:
    """{GPU memory bytes: live workers of `celery_queue` whose smallest GPU has that much}."""
    sizes: dict[int, int] = {}
    for w in workers:
        gpus = [int(g.get("memory_total_bytes") or 0) for g in w.get("gpus") or []]
        if str(w.get("queue")) == celery_queue and gpus and min(gpus) > 0:
            sizes[min(gpus)] = sizes.get(min(gpus), 0) + 1
    return sizes


def spec_step(spec: JobCreate, *, rows: int, seq: int) -> Step | None:
    """The job's step on one GPU: `rows` rows of `seq` tokens (None: the model's shape unknown)."""
    return job_step(
        spec.model,
        get_settings().model_store,
        rank=spec.lora.r,
        targets=spec.lora.target_modules,
        rows=rows,
        seq=seq,
        quantization=spec.quantization,
        dropout=spec.lora.dropout,
    )


def plans(spec: JobCreate, gpu_bytes: dict[int, int], *, rows: int, seq: int) -> list[GpuPlan]:
    """The plan of a micro-batch of `rows` rows (per GPU) of `seq` tokens on each GPU size."""
    step = spec_step(spec, rows=rows, seq=seq)
    if step is None:
        return []
    return [GpuPlan(size, count, step.plan(size)) for size, count in sorted(gpu_bytes.items())]


def gpu_rows(batch_size: int | str, spec: JobCreate) -> int:
    """Rows a micro-batch gives each GPU: batch_size ("auto": at most AUTO_BATCH_SIZE) over the
    job's ranks (n_gpus on each of n_nodes hosts), or all of it on each (batch_scaling per_gpu)."""
    rows = AUTO_BATCH_SIZE if batch_size == "auto" else int(batch_size)
    ranks = spec.n_gpus * spec.n_nodes
    return rows if spec.batch_scaling == "per_gpu" else -(-rows // ranks)


def check_fits(
    spec: JobCreate, *, batch_size: int | str, celery_queue: str, workers: list[dict[str, Any]] | None
) -> None:
    """400 when the queue's live GPU workers are known and the job fits none of their GPUs."""
    if workers is None:
        return
    rows = gpu_rows(batch_size, spec)
    found = plans(spec, queue_gpu_bytes(workers, celery_queue), rows=rows, seq=spec.max_seq_len)
    if not found or any(p.plan.fits for p in found):
        return
    largest = max(found, key=lambda p: p.gpu_bytes)
    raise InvalidRequestError(
        refusal(largest.plan, quantization=spec.quantization, rank=spec.lora.r, seq=spec.max_seq_len, rows=1)
        + f" (GPUs of queue {celery_queue!r}: {', '.join(f'{p.gpu_bytes / 2**30:.0f} GiB' for p in found)})",
        param="quantization" if spec.quantization is None else "max_seq_len",
        code="insufficient_gpu_memory",
    )


def check_quantization(spec: JobCreate) -> None:
    """400 naming `quantization` when "gguf" (keep a GGUF file's blocks) names a base that is
    not a GGUF file."""
    if spec.quantization == "gguf" and spec.model not in PRETRAINED:
        raise InvalidRequestError(
            f'invalid quantization: "gguf" keeps a GGUF base\'s own blocks, and model {spec.model!r} '
            f'is not a GGUF base (GGUF bases: {", ".join(sorted(PRETRAINED))}); use "nf4" or "int8"',
            param="quantization",
            code="invalid_quantization",
        )


def public(found: list[GpuPlan]) -> list[dict[str, Any]]:
    """The plans as the dry run shows them (MemoryPlanPublic's fields)."""
    return [{"workers": p.workers, **plan_fields(p.gpu_bytes, p.plan)} for p in found]
