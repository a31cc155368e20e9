"""Learning-rate schedules: linear warmup, then cosine / linear decay to zero, or constant.

`lr_factor(step, ...)` is the multiplier of the base learning rate for the optimizer step with
0-based index `step` (the LambdaLR convention: the scheduler has been stepped `step` times):

    warmup (step < W):   (step + 1) / W               first step already trains, reaches 1 at W-1
    after, p = (step - W) / (total - W)  in [0, 1):
      cosine:            ½·(1 + cos(π·p))
      linear:            1 − p
      constant:          1
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from worker.engine.types import SchedulerName


def warmup_steps(total_steps: int, warmup_ratio: float) -> int:
    return math.ceil(total_steps * warmup_ratio)


def lr_factor(step: int, *, total_steps: int, warmup: int, kind: SchedulerName) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total_steps - warmup)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return 1.0 - progress
    raise ValueError(f"unknown lr_scheduler {kind!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float, kind: SchedulerName
) -> LambdaLR:
    """A LambdaLR (its state_dict is plain ints/floats, so it checkpoints with weights_only)."""
    warmup = warmup_steps(total_steps, warmup_ratio)
    lr_factor(0, total_steps=total_steps, warmup=warmup, kind=kind)  # fail early on a bad kind
    return LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps=total_steps, warmup=warmup, kind=kind)
    )
