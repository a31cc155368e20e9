"""How the engine obeys a memory plan (worker/engine/memory_plan.py's MemoryChoice):

- micro-batch rows: a micro-batch of B rows runs as ⌈B / m⌉ forward/backward passes of at most m
  rows (`split_rows`). The step's loss is Σ CE / N with N the trainable tokens of the whole step
  whatever the split, so the loss and gradients are those of the whole micro-batch (up to the
  order in which the partial sums are added);
- activation checkpointing: "full" recomputes each decoder layer from its input in the backward,
  "selective" recomputes each layer's MLP only (torch.utils.checkpoint, non-reentrant, so
  keyword arguments and the packed-attention kwargs pass through). The same ops run again on the
  same inputs in the same order: losses and gradients are bit for bit those of the plain step;
- offload: the tensors the forward saves for the backward (with checkpointing, the layer inputs)
  wait in host memory (pinned on CUDA) through saved-tensor hooks (`offloaded`), copied back for
  the backward: copies, so again bit for bit.

Checkpointing replaces an instance's `forward` (module paths, parameters and state dicts do not
change); `remove_checkpointing` restores them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from worker.engine.data import Batch
from worker.engine.memory_plan import Checkpointing, MemoryChoice, MemoryPlan, ModelDims, plan_memory
from worker.engine.types import ConfigError

_PATCHED = "_loraq_checkpointed"


def split_rows(batch: Batch, rows: int | None) -> list[Batch]:
    """`batch` cut into consecutive parts of at most `rows` rows (None: the batch itself)."""
    n = batch.input_ids.shape[0]
    if rows is None or rows >= n:
        return [batch]
    parts = []
    for start in range(0, n, rows):
        s = slice(start, start + rows)
        row_ids = batch.row_ids[s] if batch.row_ids is not None else None
        parts.append(
            Batch(
                batch.input_ids[s],
                batch.labels[s],
                batch.attention_mask[s],
                batch.position_ids[s],
                batch.packed,
                row_ids,
            )
        )
    return parts


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a *ForCausalLM (`model.model.layers`), or [] where it has none."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def _checkpointed(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation, sampling: nothing to save, nothing to recompute
        return original(*args, **kwargs)
    return checkpoint(original, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: nn.Module, mode: Checkpointing) -> int:
    """Checkpoint every decoder layer ("full") or every layer's MLP ("selective"); returns how
    many modules now recompute in the backward."""
    remove_checkpointing(model)
    if mode == "none":
        return 0
    targets = decoder_layers(model)
    if mode == "selective":
        targets = [m for layer in targets if isinstance(m := getattr(layer, "mlp", None), nn.Module)]
    for module in targets:
        module.forward = functools.partial(_checkpointed, module.forward)
        setattr(module, _PATCHED, True)
    return len(targets)


def remove_checkpointing(model: nn.Module) -> None:
    for module in model.modules():
        if module.__dict__.pop(_PATCHED, False):
            del module.forward


@contextlib.contextmanager
def offloaded(enabled: bool, device: torch.device) -> Iterator[None]:
    """Inside: what autograd saves for the backward is kept in host memory (pinned on CUDA)."""
    if not enabled:
        yield
        return
    with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
        yield


def expandable_segments() -> bool:
    """Have the CUDA caching allocator grow segments in place (`expandable_segments`) unless the
    operator configured it in PYTORCH_CUDA_ALLOC_CONF (`expandable_segments:False` keeps it off).
    Without it, an 8B NF4 step capped at 8.9 GiB ran out of memory with 6.9 GiB live: the rest was
    blocks cut for other sizes (the eager warm-up step, the graph's pool), which the plan cannot
    predict. Returns whether it is on. Takes effect for the segments allocated after the call."""
    if not torch.cuda.is_available():
        return False
    configured = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in configured:
        return "expandable_segments:True" in configured
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True


def plan_on_device(
    model: nn.Module,
    *,
    device: torch.device,
    rank: int,
    targets: list[str] | str,
    rows: int,
    seq: int,
    quantization: str | None,
    allow_offload: bool = True,
    dropout: float = 0.0,
) -> MemoryPlan:
    """The plan for this GPU as it is now: its free memory plus what this process holds already
    (the base is loaded: the plan counts its weights), no more than the process's cap where one
    is set (`torch.cuda.set_per_process_memory_fraction`: a GPU shared with other work, or a
    benchmark that measures at a smaller card's size)."""
    # An indexed device: torch.cuda.get_per_process_memory_fraction refuses a bare "cuda".
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    budget = free + torch.cuda.memory_allocated(index)
    fraction = torch.cuda.get_per_process_memory_fraction(index)
    if fraction < 1.0:
        budget = min(budget, int(fraction * total))
    dims = ModelDims.from_config(getattr(model, "config").to_dict())  # noqa: B009 (a PreTrainedModel)
    return plan_memory(
        dims,
        rank=rank,
        targets=targets,
        rows=rows,
        seq=seq,
        gpu_bytes=budget,
        quantization=quantization,
        allow_offload=allow_offload,
        dropout=dropout,
    )


def plan_data(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as a job's first event carries it: the choice, the predicted peak by part (bytes),
    the limit it was made for and whether it fits."""
    return {
        "memory_plan": {
            **dataclasses.asdict(plan.choice),
            "predicted_peak_bytes": plan.peak_bytes,
            "limit_bytes": plan.limit_bytes,
            "fits": plan.fits,
            "breakdown": dict(plan.breakdown),
        }
    }


def obey(
    config: Any,
    model: nn.Module,
    device: torch.device,
    *,
    rows: int,
    seq: int,
    announce: Callable[..., None],
    allow_offload: bool = True,
) -> MemoryChoice:
    """The run's MemoryChoice: `config.memory` where set, else the plan for this GPU (on the CPU:
    nothing split or recomputed); checkpointing applied to `model`; `announce(level, message)`
    says the plan once (a warning where it needs checkpointing or does not fit), its data
    `plan_data`. Offload runs on
    the eager step only (the captured step's saved tensors stay on the GPU): without
    `allow_offload` the plan does without it, and a config asking for it is an error."""
    choice: MemoryChoice | None = config.memory
    if choice is not None and choice.offload and not allow_offload:
        raise ConfigError(
            "memory", "offloading activations needs the eager step; this run takes the captured one"
        )
    if choice is None and device.type == "cuda":
        plan = plan_on_device(
            model,
            device=device,
            rank=config.lora.r,
            targets=config.lora.target_modules,
            rows=rows,
            seq=seq,
            quantization=config.quantization,
            allow_offload=allow_offload,
            dropout=config.lora.dropout,
        )
        choice = plan.choice
        needs = choice.checkpointing != "none" or choice.offload
        level = "warn" if not plan.fits or needs else "info"
        note = " (fits only with activation checkpointing)" if needs and plan.fits else ""
        announce(level, f"Memory plan: {plan.sentence()}{note}", plan_data(plan))
    choice = choice or MemoryChoice()
    if config.method.type != "supervised":  # a preference pair's rows must stay in one pass
        choice = MemoryChoice(None, choice.checkpointing, choice.offload)
    apply_checkpointing(model, choice.checkpointing)
    return choice
