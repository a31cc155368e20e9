"""Plain-torch variable-length causal attention (one SDPA call per sequence): the CPU path of
gpu_kernels.ops.varlen and its test oracle."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def varlen_attention(
    q: torch.Tensor,  # (N, H, D): the tokens of all sequences, concatenated
    k: torch.Tensor,  # (N, G, D), H % G == 0
    v: torch.Tensor,  # (N, G, D)
    cu_seqlens: torch.Tensor,  # (K + 1,) int32, 0 = cu[0] <= cu[1] <= ... <= cu[K] = N
    max_seqlen: int,  # >= every cu[i+1] - cu[i]
    scale: float | None = None,
    window: int | None = None,  # W: a token sees itself and the W - 1 before it; None: all before
) -> torch.Tensor:
    """Causal attention inside each sequence [cu[i], cu[i+1]) and never across: (N, H, D);
    with a window, through a banded mask (the compiled twin passes the window to the kernel).

    Zero-length sequences (repeated offsets, how a fixed-size cu_seqlens is padded) are allowed.
    One SDPA call per sequence: exact, mask-free, and slow (it reads the offsets on the host);
    the compiled twin is one variable-length flash-attention call."""
    if window is not None and window < 1:
        raise ValueError(f"attention window must be at least 1 token, got {window}")
    offsets = [int(x) for x in cu_seqlens.tolist()]
    if offsets[0] != 0 or offsets[-1] != q.shape[0] or any(b < a for a, b in itertools.pairwise(offsets)):
        raise ValueError(f"cu_seqlens must rise from 0 to {q.shape[0]}, got {offsets}")
    if max(b - a for a, b in itertools.pairwise(offsets)) > max_seqlen:
        raise ValueError(f"a sequence is longer than max_seqlen {max_seqlen}")
    heads, groups = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for a, b in itertools.pairwise(offsets):
        if b == a:
            continue
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # (heads, L, D)
        if groups != heads:
            ks, vs = ks.repeat_interleave(heads // groups, 0), vs.repeat_interleave(heads // groups, 0)
        if window is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        else:
            i = torch.arange(b - a, device=q.device)
            band = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)  # (L, L) query x key
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=band, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out
