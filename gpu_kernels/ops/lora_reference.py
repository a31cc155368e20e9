"""Plain-torch LoRA linear (one projection, or several sharing their input) and the compiled
dropout's hash mask: the CPU path of gpu_kernels.ops.lora and its test oracle.

Shapes: x (..., in); W (out, in) frozen; A (r, in) and B (out, r) trainable; scale s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from gpu_kernels.quant.frozen import FrozenWeight, base_linear

_M32 = 0xFFFFFFFF


def lora_linear(
    x: torch.Tensor,  # (..., in)
    weight: torch.Tensor | FrozenWeight,  # (out, in), frozen (dense, or quantized: tiled)
    bias: torch.Tensor | None,  # (out,)
    lora_a: torch.Tensor,  # (r, in), trainable
    lora_b: torch.Tensor,  # (out, r), trainable
    scale: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """y = x·Wᵀ + b + s·(drop(x)·Aᵀ)·Bᵀ, shape (..., out)."""
    y = base_linear(x, weight, bias)
    xa = F.dropout(x, p=dropout_p, training=training) if dropout_p > 0 else x
    # (..., in) @ (in, r) -> (..., r) @ (r, out): never forms a full (out, in) delta
    return y + scale * _low_rank(xa, lora_a, lora_b).to(y.dtype)


def _low_rank(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(x·Aᵀ)·Bᵀ, (..., in) -> (..., out), in x's dtype where it is floating: the factors (fp32
    masters) are cast to it, as the fused kernels multiply bf16 copies. Casting x up instead made
    every LoRA op of a quantized base (which runs here, not in the fused kernels) save an fp32
    copy of its input per adapter for the backward: 2.5x the activations the memory plan expects
    (a 70B NF4 step ran out of memory on 80 GB). Gradients still reach the fp32 factors."""
    if x.is_floating_point() and x.dtype != a.dtype:
        a, b = a.to(x.dtype), b.to(x.dtype)
    return F.linear(F.linear(x, a), b)


def lora_linear_grouped(
    x: torch.Tensor,  # (..., in)
    weight: torch.Tensor | FrozenWeight,  # (Σ out_j, in): the projections sharing x, stacked
    bias: torch.Tensor | None,  # (Σ out_j,)
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]],  # (A_j (r_j, in), B_j (out_j, r_j), s_j)
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """[y_1 | y_2 | ...] with y_j = x·W_jᵀ + b_j + s_j·(drop(x)·A_jᵀ)·B_jᵀ, shape (..., Σ out_j).

    Projections that read the same input (q/k/v, gate/up) share one dropout mask, as PEFT does
    when they are separate modules only if the masks happen to agree; here one draw serves all.
    """
    y = base_linear(x, weight, bias)
    xa = F.dropout(x, p=dropout_p, training=training) if dropout_p > 0 else x
    outs = []
    col = 0
    for a, b, s in adapters:
        n = b.shape[0]
        lora = s * _low_rank(xa, a, b)
        outs.append(y[..., col : col + n] + lora.to(y.dtype))
        col += n
    if col != y.shape[-1]:
        raise ValueError(f"adapters cover {col} output features but weight has {y.shape[-1]}")
    return torch.cat(outs, dim=-1)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2^32), exactly as csrc/lora.cu does it.
    Multiplications are split in 16-bit halves so no int64 product overflows."""

    def mul32(v: torch.Tensor, c: int) -> torch.Tensor:
        lo, hi = c & 0xFFFF, c >> 16
        return (v * lo + (((v * hi) & 0xFFFF) << 16)) & _M32

    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_mask(
    numel: int, p: float, seed: int, salt: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The keep-mask (bool, numel) of the compiled dropout for this seed and salt."""
    salt_h = int(_hash32(torch.tensor([salt & _M32], dtype=torch.int64))[0])
    key = int(_hash32(torch.tensor([(seed & _M32) ^ salt_h], dtype=torch.int64))[0])
    idx = torch.arange(numel, dtype=torch.int64, device=device) & _M32
    h = _hash32(idx ^ key)
    return (h >> 8) >= int(p * 16777216.0)


def hash_dropout(x: torch.Tensor, p: float, seed: int, salt: int) -> torch.Tensor:
    """x ⊙ mask / (1 − p) with the compiled kernel's counter-based mask (for tests)."""
    keep = dropout_mask(x.numel(), p, seed, salt, x.device).view(x.shape)
    return torch.where(keep, x.float() / (1.0 - p), 0.0).to(x.dtype)
