"""Plain-torch RMSNorm and SwiGLU: the CPU path of gpu_kernels.ops.norm_act and its test
oracle. Math in fp32 (fp64 for fp64 inputs), rounded once to the input's dtype, as the kernels do."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_kernels.ops.precision import accumulation


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w ⊙ x / sqrt(mean(x², -1) + eps) for x (..., D), w (D,), computed in fp32 and rounded
    once to x's dtype."""
    xf = accumulation(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (accumulation(weight).to(xf.dtype) * (xf * rstd)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) ⊙ up for two (..., F) tensors, computed in fp32 and rounded once."""
    return (F.silu(accumulation(gate)) * accumulation(up)).to(gate.dtype)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu of the two halves of the last dim: (..., 2F) -> (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up)
