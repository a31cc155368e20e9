"""Plain-torch reference of every op in gpu_kernels: the CPU path and the test oracle.

Each function here has a compiled twin in gpu_kernels/ops/ with the same signature and the same
math; gpu_kernels.dispatch picks one per call.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF


def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in its accumulation dtype: fp32 for 16-bit inputs, unchanged for fp32/fp64 (so a
    float64 call of a reference is a float64 oracle)."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def lora_linear(
    x: torch.Tensor,  # (..., in)
    weight: torch.Tensor,  # (out, in), frozen
    bias: torch.Tensor | None,  # (out,)
    lora_a: torch.Tensor,  # (r, in), trainable
    lora_b: torch.Tensor,  # (out, r), trainable
    scale: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """y = x·Wᵀ + b + s·(drop(x)·Aᵀ)·Bᵀ, shape (..., out)."""
    y = F.linear(x, weight, bias)
    xa = F.dropout(x, p=dropout_p, training=training) if dropout_p > 0 else x
    # (..., in) @ (in, r) -> (..., r) @ (r, out): never forms a full (out, in) delta
    return y + scale * F.linear(F.linear(xa.to(lora_a.dtype), lora_a), lora_b).to(y.dtype)


def lora_linear_grouped(
    x: torch.Tensor,  # (..., in)
    weight: torch.Tensor,  # (Σ out_j, in): the projections sharing x, stacked
    bias: torch.Tensor | None,  # (Σ out_j,)
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]],  # (A_j (r_j, in), B_j (out_j, r_j), s_j)
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    """[y_1 | y_2 | ...] with y_j = x·W_jᵀ + b_j + s_j·(drop(x)·A_jᵀ)·B_jᵀ, shape (..., Σ out_j).

    Projections that read the same input (q/k/v, gate/up) share one dropout mask, as PEFT does
    when they are separate modules only if the masks happen to agree; here one draw serves all.
    """
    y = F.linear(x, weight, bias)
    xa = F.dropout(x, p=dropout_p, training=training) if dropout_p > 0 else x
    outs = []
    col = 0
    for a, b, s in adapters:
        n = b.shape[0]
        lora = s * F.linear(F.linear(xa.to(a.dtype), a), b)
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w ⊙ x / sqrt(mean(x², -1) + eps), computed in fp32 and rounded once to x's dtype."""
    xf = _acc(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (_acc(weight).to(xf.dtype) * (xf * rstd)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) ⊙ up, computed in fp32 and rounded once."""
    return (F.silu(_acc(gate)) * _acc(up)).to(gate.dtype)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """swiglu of the two halves of the last dim: (..., 2F) -> (..., F)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split q/k/v and rotate q and k (Llama's rotate-half RoPE, in fp32, rounded once).

    Returns q (B, H, S, D), k and v (B, G, S, D): attention's layout, as views of (B, S, ·, D)."""
    b, s, width = qkv.shape
    d = rope_head_size(width, n_heads, n_kv_heads)
    x = qkv.view(b, s, n_heads + 2 * n_kv_heads, d)
    q, k, v = x.split([n_heads, n_kv_heads, n_kv_heads], dim=2)
    c, sn = _acc(cos).unsqueeze(2), _acc(sin).unsqueeze(2)  # (·, S, 1, D)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        tf = _acc(t)
        t1, t2 = tf.chunk(2, dim=-1)
        return (tf * c + torch.cat((-t2, t1), dim=-1) * sn).to(t.dtype)

    return rotate(q).transpose(1, 2), rotate(k).transpose(1, 2), v.transpose(1, 2)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,  # (..., d)
    weight: torch.Tensor,  # (V, d)
    targets: torch.Tensor,  # (...,) int64
    ignore_index: int = -100,
    scale: torch.Tensor | None = None,  # 0-d; replaces 1/count
) -> torch.Tensor:
    """Mean cross-entropy of hidden·Wᵀ over the targets that are not ignore_index (0 if none),
    or, given `scale`, the sum of those cross-entropies times scale (a training step divides
    by the trainable tokens of all its micro-batches, which one call does not see).
    Logits are formed in the hidden dtype and the loss is taken in fp32, as HF does."""
    logits = _acc(F.linear(hidden, weight)).reshape(-1, weight.shape[0])
    t = targets.reshape(-1)
    total = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")
    if scale is not None:
        return total * scale.to(total.dtype)
    count = (t != ignore_index).sum().clamp(min=1)
    return total / count.to(total.dtype)


def varlen_attention(
    q: torch.Tensor,  # (N, H, D): the tokens of all sequences, concatenated
    k: torch.Tensor,  # (N, G, D), H % G == 0
    v: torch.Tensor,  # (N, G, D)
    cu_seqlens: torch.Tensor,  # (K + 1,) int32, 0 = cu[0] <= cu[1] <= ... <= cu[K] = N
    max_seqlen: int,  # >= every cu[i+1] - cu[i]
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention inside each sequence [cu[i], cu[i+1]) and never across: (N, H, D).

    Zero-length sequences (repeated offsets, how a fixed-size cu_seqlens is padded) are allowed.
    One SDPA call per sequence: exact, mask-free, and slow (it reads the offsets on the host);
    the compiled twin is one variable-length flash-attention call."""
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
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        out[a:b] = o.transpose(0, 1)
    return out


def new_nonfinite_state(device: torch.device | str) -> torch.Tensor:
    """int64[2]: [first non-finite step (0 = none), steps counted]; see clip_grad_norm_."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, nonfinite_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale grads in place so their global L2 norm is at most max_norm; returns the norm
    (before clipping) as a 0-d float32 tensor on the grads' device. Non-finite norms are
    returned as is and grads are left unscaled, for the caller to report. With
    `nonfinite_state` (see new_nonfinite_state) the step is counted and the first step with a
    non-finite norm is recorded there, on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([g.detach().float().norm(2) for g in grads])
    total = norms.norm(2)
    finite = torch.isfinite(total)
    # torch.where instead of `if finite:` keeps this free of host syncs
    coef = torch.where(finite, torch.clamp(max_norm / (total + 1e-6), max=1.0), torch.ones_like(total))
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    if nonfinite_state is not None:
        nonfinite_state[1] += 1
        first_bad = (nonfinite_state[0] == 0) & ~finite
        nonfinite_state[0] = torch.where(first_bad, nonfinite_state[1], nonfinite_state[0])
    return total


def lora_linear_multi(
    x: torch.Tensor,  # (B, S, in): row b of the batch uses adapter index[b]
    weight: torch.Tensor,  # (out, in), the shared frozen base
    bias: torch.Tensor | None,  # (out,)
    lora_a: torch.Tensor,  # (N, r, in): N adapter slots, ranks zero-padded to r
    lora_b: torch.Tensor,  # (N, out, r)
    scales: torch.Tensor,  # (N,) fp32; a slot of scale 0 (or zero factors) is "no adapter"
    index: torch.Tensor,  # (B,) int64 in [0, N)
) -> torch.Tensor:
    """Mixed-adapter batch (BGMV: a gathered batched GEMV per row), shape (B, S, out):

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
