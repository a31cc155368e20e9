"""The accumulation dtype the references compute in, shared by every op's reference."""

from __future__ import annotations

import torch


def accumulation(t: torch.Tensor) -> torch.Tensor:
    """t in its accumulation dtype: fp32 for 16-bit inputs, unchanged for fp32/fp64 (so a
    float64 call of a reference is a float64 oracle)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
