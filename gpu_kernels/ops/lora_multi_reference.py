"""Plain-torch mixed-adapter LoRA (BGMV: a gathered batched GEMV per row): the CPU path of
gpu_kernels.ops.lora_multi and its test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_linear_multi(
    x: torch.Tensor,  # (B, S, in): row b of the batch uses adapter index[b]
    weight: torch.Tensor,  # (out, in), the shared frozen base
    bias: torch.Tensor | None,  # (out,)
    lora_a: torch.Tensor,  # (N, r, in): N adapter slots, ranks zero-padded to r
    lora_b: torch.Tensor,  # (N, out, r)
    scales: torch.Tensor,  # (N,) fp32; a slot of scale 0 (or zero factors) is "no adapter"
    index: torch.Tensor,  # (B,) int64 in [0, N)
) -> torch.Tensor:
    """Mixed-adapter batch, shape (B, S, out):

        y[b] = x[b]·Wᵀ + bias + scales[i]·(x[b]·A[i]ᵀ)·B[i]ᵀ,   i = index[b]

    Zero-padded ranks add exact zeros, so slots of different ranks share one stack.
    """
    y = F.linear(x, weight, bias)
    a = lora_a[index]  # (B, r, in)
    b = lora_b[index]  # (B, out, r)
    s = scales[index].to(a.dtype)  # (B,)
    xa = torch.bmm(x.to(a.dtype), a.transpose(1, 2))  # (B, S, r)
    delta = torch.bmm(xa, b.transpose(1, 2)) * s[:, None, None]  # (B, S, out)
    return y + delta.to(y.dtype)
