"""Plain-torch RMSNorm and gated MLP activation: the CPU path of gpu_kernels.ops.norm_act and
its test oracle. Math in fp32 (fp64 for fp64 inputs), rounded once to the input's dtype, as the
kernels do."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from gpu_kernels.ops.precision import accumulation

# the gate's activation: SiLU (SwiGLU) or GELU with the tanh approximation (GeGLU)
Activation = Literal["silu", "gelu_tanh"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """(offset + w) ⊙ x / sqrt(mean(x², -1) + eps) for x (..., D), w (D,), computed in fp32 and
    rounded once to x's dtype. offset 1: Gemma's weights, stored as w − 1."""
    xf = accumulation(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((offset + accumulation(weight).to(xf.dtype)) * (xf * rstd)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
    """act(gate) ⊙ up for two (..., F) tensors, computed in fp32 and rounded once; act is SiLU
    or, for "gelu_tanh", GELU's tanh approximation (GeGLU)."""
    g = accumulation(gate)
    a = F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")
    return (a * accumulation(up)).to(gate.dtype)


def swiglu_packed(gate_up: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
    """swiglu of the two halves of the last dim: (..., 2F) -> (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up, activation)
