"""The per-head q/k norm, RoPE and variable-length attention as one autograd op that keeps the
projected q/k/v rows for the backward instead of the normalised, rotated q/k/v.

Why: with a q/k norm (Qwen3, Gemma 3) the norm's backward needs its input, the rows as projected,
while flash attention's backward needs its own inputs, the rows normalised and rotated. Two ops
keep both: (H + 2G)·D bf16 more per token and layer than a family without the norm, 12 kB for
Qwen3-8B (1.7 GiB of a 2 × 2,048-token step). This op keeps only the projected rows and rotates
them again in the backward (one elementwise kernel, gpu_kernels.ops.rope.RopeCall.rotate), so a
q/k-norm family saves what Llama saves. Flash attention reads v in place from the rows (a view
with their row stride), so neither pass copies it. The recomputed q/k/v are the forward's bit for
bit (the same kernel on the same rows), so losses and gradients equal those of rope_qkv followed
by varlen_attention exactly.

Shapes: qkv (B, S, (H + 2G)·D); cos/sin and positions as gpu_kernels.ops.rope; the B·S tokens are
packed sequences at cu_seqlens (K + 1,) offsets; the output is (B·S, H, D).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_kernels.ops import varlen
from gpu_kernels.ops.rope import RopeCall
from gpu_kernels.ops.rope_reference import packed_rows


class RoPEVarlenAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        n_heads: int,
        n_kv: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        offset: float,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        scale: float | None,
        window: int | None,
    ) -> torch.Tensor:
        x = qkv.contiguous()
        call = RopeCall.of(x, cos, sin, positions, n_heads, n_kv, q_weight, k_weight, eps, offset)
        q, k, v = (packed_rows(t) for t in call.rotate(x, v_in_place=True))
        cu = varlen.int32_offsets(cu_seqlens)
        attention = (max_seqlen, scale, varlen.flash_window(window))
        out, state = varlen.flash_forward(q, k, v, cu, *attention)
        # q/k/v die here: the backward rotates x again
        ctx.save_for_backward(x, out, cu, *state, *call.tensors())
        ctx.meta = (call.meta(), attention, len(state))
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        rope_meta, attention, n_state = ctx.meta
        x, out, cu, *rest = ctx.saved_tensors
        state, tensors = rest[:n_state], rest[n_state:]
        call = RopeCall.restored(tensors, rope_meta)
        b, s = x.shape[:2]
        q, k, v = (packed_rows(t) for t in call.rotate(x, v_in_place=True))
        dq, dk, dv = varlen.flash_backward(grad_out, q, k, v, out, state, cu, *attention)
        # (B·S, heads, D) -> (B, heads, S, D) views in the strides the rope backward reads
        grads = (g.view(b, s, g.shape[1], g.shape[2]).transpose(1, 2) for g in (dq, dk, dv))
        dqkv = call.unrotate(x, *grads)
        return (dqkv, *([None] * 13))


def rope_varlen_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    positions: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    offset: float,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    out = RoPEVarlenAttentionFunction.apply(
        qkv, cos, sin, positions, n_heads, n_kv_heads, q_weight, k_weight, eps, offset,
        cu_seqlens, max_seqlen, scale, window,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)
    return out
