"""Plain-torch rotary embedding fused with the q/k/v split: the CPU path of
gpu_kernels.ops.rope and its test oracle (Llama's rotate-half RoPE, in fp32, rounded once).

Per family: the cos/sin tables may cover only the first R < D dims of a head (partial rotary,
Phi-4-mini; the rest passes unrotated), and q and k may go through a per-head RMSNorm first
(`HeadNorm`: Qwen3, Gemma 3)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from gpu_kernels.ops.precision import accumulation


class HeadNorm(NamedTuple):
    """Per-head RMSNorm of q and k between the projection and RoPE: (offset + w) ⊙ x · rstd over
    each head's D elements, one weight for every q head and one for every k head."""

    q_weight: torch.Tensor  # (D,)
    k_weight: torch.Tensor  # (D,)
    eps: float
    offset: float = 0.0  # 1 for Gemma's weights (stored as w − 1)


def packed_rows(t: torch.Tensor) -> torch.Tensor:
    """q, k or v (B, heads, S, D) stored as (B, S, heads, D) rows -> the packed (B·S, heads, D)
    layout variable-length attention reads: a view, no copy."""
    b, heads, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, heads, d)


def rope_head_size(width: int, n_heads: int, n_kv_heads: int) -> int:
    """The head size D of packed q/k/v rows of `width` = (H + 2G)·D features."""
    heads = n_heads + 2 * n_kv_heads
    if n_heads < 1 or n_kv_heads < 1 or width % heads:
        raise ValueError(
            f"packed q/k/v width {width} is not a whole number of heads: "
            f"n_heads={n_heads} + 2·n_kv_heads={n_kv_heads} = {heads} heads"
        )
    return width // heads


def rope_qkv(
    qkv: torch.Tensor,  # (B, S, (H + 2G)·D): a token's q, k and v heads side by side
    cos: torch.Tensor,  # (1 or B, S, D)
    sin: torch.Tensor,  # (1 or B, S, D)
    n_heads: int,
    n_kv_heads: int,
    positions: torch.Tensor | None = None,  # (B, S): then cos, sin are (1, P, R) read by position
    norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split q/k/v, normalise q and k per head when `norm` is given, and rotate the first R dims
    of q and k (R = cos.shape[-1] <= D, even; the other D − R dims pass); token (b, s) takes
    cos/sin row (b or 0, s), or row positions[b, s] of the one table when positions are given.

    Returns q (B, H, S, D), k and v (B, G, S, D): attention's layout, as views of (B, S, ·, D)."""
    b, s, width = qkv.shape
    d = rope_head_size(width, n_heads, n_kv_heads)
    r = rotary_dims(cos, sin, d)
    if positions is not None:
        if cos.dim() != 3 or cos.shape[0] != 1 or sin.shape != cos.shape:
            raise ValueError(f"cos/sin read by position must both be (1, P, R), got {tuple(cos.shape)}")
        cos, sin = cos[0][positions], sin[0][positions]  # (B, S, R)
    x = qkv.view(b, s, n_heads + 2 * n_kv_heads, d)
    q, k, v = x.split([n_heads, n_kv_heads, n_kv_heads], dim=2)
    c, sn = accumulation(cos).unsqueeze(2), accumulation(sin).unsqueeze(2)  # (·, S, 1, R)

    def rotate(t: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        tf = accumulation(t)  # (B, S, heads, D)
        if norm is not None and weight is not None:
            rstd = torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + norm.eps)
            tf = tf * rstd * (norm.offset + accumulation(weight).to(tf.dtype))
        rot, rest = tf[..., :r], tf[..., r:]
        t1, t2 = rot.chunk(2, dim=-1)
        return torch.cat((rot * c + torch.cat((-t2, t1), dim=-1) * sn, rest), dim=-1).to(t.dtype)

    qw, kw = (norm.q_weight, norm.k_weight) if norm is not None else (None, None)
    return rotate(q, qw).transpose(1, 2), rotate(k, kw).transpose(1, 2), v.transpose(1, 2)


def rotary_dims(cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> int:
    """R, the rotated dims of each head: cos/sin's last dim, even and at most the head size."""
    r = int(cos.shape[-1])
    if sin.shape[-1] != r or r % 2 or not 2 <= r <= head_size:
        raise ValueError(
            f"cos/sin's last dim {r} (the rotated dims) must be even, at most the head size {head_size}, "
            f"and the same for both (sin's is {sin.shape[-1]})"
        )
    return r
