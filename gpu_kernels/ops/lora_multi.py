"""Mixed-adapter LoRA for serving, SGMV-style (Punica, S-LoRA): rows that share an adapter form a
segment, and each segment runs one pair of GEMMs over all its tokens, instead of gathering a
private copy of A and B per row (lora_multi_reference.lora_linear_multi, the BGMV twin and test
oracle).

On a GPU this does one (tokens_i, in)·(in, r) and one (tokens_i, r)·(r, out) GEMM per distinct
adapter i in the batch, so the cost grows with the number of adapters in use, not with the batch
size, and no (B, out, r) gather is materialised. It is plain torch (cuBLAS GEMMs), not a fused
CUDA kernel: a single-launch SGMV kernel in csrc/ is future work.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lora_linear_multi(
    x: torch.Tensor,  # (B, S, in)
    weight: torch.Tensor,  # (out, in)
    bias: torch.Tensor | None,  # (out,)
    lora_a: torch.Tensor,  # (N, r, in)
    lora_b: torch.Tensor,  # (N, out, r)
    scales: torch.Tensor,  # (N,)
    index: torch.Tensor,  # (B,) int64
) -> torch.Tensor:
    """Same math and shapes as lora_multi_reference.lora_linear_multi."""
    y = F.linear(x, weight, bias)
    # One host sync per call for the segment boundaries; rows of one adapter, in batch order.
    for slot in torch.unique(index).tolist():
        rows = (index == slot).nonzero(as_tuple=True)[0]  # (B_i,)
        xs = x.index_select(0, rows).to(lora_a.dtype)  # (B_i, S, in)
        delta = F.linear(F.linear(xs, lora_a[slot]), lora_b[slot]) * scales[slot]  # (B_i, S, out)
        y.index_add_(0, rows, delta.to(y.dtype))
    return y
