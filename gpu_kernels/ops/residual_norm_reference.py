"""Plain-torch residual add + RMSNorm: the CPU path of gpu_kernels.ops.residual_norm and its test
oracle. Exactly the separate ops a decoder layer runs: the sublayer's output normalised first
where `delta_norm` is given (Gemma's sandwich norms), added to the residual stream in its dtype,
then the stream normalised."""

from __future__ import annotations

import torch

from gpu_kernels.ops.norm_act_reference import rms_norm

# (weight (D,), eps) of the norm on the sublayer's output, with the family's offset
DeltaNorm = tuple[torch.Tensor, float]


def add_rms_norm(
    residual: torch.Tensor,  # (..., D): the residual stream
    delta: torch.Tensor,  # (..., D): the sublayer's output
    weight: torch.Tensor,  # (D,)
    eps: float,
    offset: float = 0.0,
    delta_norm: DeltaNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)) with h = residual + delta, or residual + norm_p(delta) given delta_norm."""
    if delta_norm is not None:
        delta = rms_norm(delta, delta_norm[0], delta_norm[1], offset)
    h = residual + delta
    return h, rms_norm(h, weight, eps, offset)
