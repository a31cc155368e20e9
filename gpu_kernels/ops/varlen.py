"""Variable-length causal attention on the GPU: PyTorch's flash-attention kernels over packed
sequences, called through their aten entry points (what `torch.nn.attention.varlen` wraps, whose
Python signature has changed between releases; the aten ops' has not).

Shapes: q (N, H, D), k and v (N, G, D) with H % G == 0 (grouped-query attention without
repeating k/v), cu_seqlens (K + 1,) int32 offsets of the K sequences in the N tokens,
max_seqlen a host int bounding every sequence's length; an attention window W (Mistral, Gemma 3's
sliding layers) is flash-attention's window_size_left = W − 1, right 0: no mask. Zero-length
sequences (a cu_seqlens padded to a fixed K by repeating N) cost an early exit per block.
Nothing reads device values on the host, so a call is capturable in a CUDA graph when cu_seqlens
lives in a static buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

Window = tuple[int | None, int | None]  # flash-attention's (left, right); (None, None): none


def flash_window(window: int | None) -> Window:
    """A window of W tokens (itself and the W − 1 before it) as flash attention's arguments."""
    if window is not None and window < 1:
        raise ValueError(f"attention window must be at least 1 token, got {window}")
    return (window - 1, 0) if window is not None else (None, None)


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_seqlen: int,
    scale: float | None, window: Window,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
    """out (N, H, D), and what the backward reads besides q/k/v/out: (lse, rng_state, unused)."""
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale,
        window_size_left=window[0], window_size_right=window[1],
    )  # fmt: skip
    return out, (lse, rng_state, unused)


def flash_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    state: Sequence[torch.Tensor], cu: torch.Tensor, max_seqlen: int, scale: float | None, window: Window,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dq (N, H, D), dk and dv (N, G, D)."""
    lse, rng_state, unused = state
    m = max_seqlen
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, cu, cu, m, m, 0.0, True, rng_state, unused,
        scale=scale, window_size_left=window[0], window_size_right=window[1],
    )  # fmt: skip
    return dq, dk, dv


def int32_offsets(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)


class VarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        cu = int32_offsets(cu_seqlens)
        ctx.meta = (max_seqlen, scale, flash_window(window))
        out, state = flash_forward(q, k, v, cu, *ctx.meta)
        ctx.save_for_backward(q, k, v, out, cu, *state)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        q, k, v, out, cu, *state = ctx.saved_tensors
        dq, dk, dv = flash_backward(grad_out, q, k, v, out, state, cu, *ctx.meta)
        return dq, dk, dv, None, None, None, None


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    out = VarlenAttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, scale, window)
    assert isinstance(out, torch.Tensor)
    return out
