"""Plain-torch linear + cross-entropy (the logits formed whole): the CPU path of
gpu_kernels.ops.cross_entropy and its test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_kernels.ops.precision import accumulation


def fused_linear_cross_entropy(
    hidden: torch.Tensor,  # (..., d)
    weight: torch.Tensor,  # (V, d)
    targets: torch.Tensor,  # (...,) int64
    ignore_index: int = -100,
    scale: torch.Tensor | None = None,  # 0-d; replaces 1/count
) -> torch.Tensor:
    """Mean cross-entropy of hidden·Wᵀ over the targets that are not ignore_index (0 if none),
    or, given `scale`, the sum of those cross-entropies times scale (a training step divides
    by the trainable tokens of all its micro-batches, which one call does not see).
    Logits are formed in the hidden dtype and the loss is taken in fp32, as HF does."""
    logits = accumulation(F.linear(hidden, weight)).reshape(-1, weight.shape[0])
    t = targets.reshape(-1)
    total = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")
    if scale is not None:
        return total * scale.to(total.dtype)
    count = (t != ignore_index).sum().clamp(min=1)
    return total / count.to(total.dtype)
