"""Plain-torch rotary embedding fused with the q/k/v split: the CPU path of
gpu_kernels.ops.rope and its test oracle (Llama's rotate-half RoPE, in fp32, rounded once)."""

from __future__ import annotations

import torch

from gpu_kernels.ops.precision import accumulation


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
    positions: torch.Tensor | None = None,  # (B, S): then cos, sin are (1, P, D) read by position
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split q/k/v and rotate q and k; token (b, s) takes cos/sin row (b or 0, s), or row
    positions[b, s] of the one table when positions are given.

    Returns q (B, H, S, D), k and v (B, G, S, D): attention's layout, as views of (B, S, ·, D)."""
    b, s, width = qkv.shape
    d = rope_head_size(width, n_heads, n_kv_heads)
    if positions is not None:
        if cos.dim() != 3 or cos.shape[0] != 1 or sin.shape != cos.shape:
            raise ValueError(f"cos/sin read by position must both be (1, P, D), got {tuple(cos.shape)}")
        cos, sin = cos[0][positions], sin[0][positions]  # (B, S, D)
    x = qkv.view(b, s, n_heads + 2 * n_kv_heads, d)
    q, k, v = x.split([n_heads, n_kv_heads, n_kv_heads], dim=2)
    c, sn = accumulation(cos).unsqueeze(2), accumulation(sin).unsqueeze(2)  # (·, S, 1, D)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = accumulation(t)
        t1, t2 = tf.chunk(2, dim=-1)
        return (tf * c + torch.cat((-t2, t1), dim=-1) * sn).to(t.dtype)

    return rotate(q).transpose(1, 2), rotate(k).transpose(1, 2), v.transpose(1, 2)
