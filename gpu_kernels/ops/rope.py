"""Rotary embedding fused with the q/k/v split (csrc/rope.cu), forward and backward.

Shapes: qkv (B, S, (H + 2G)·D) from the grouped q/k/v projection; cos, sin (1 or B, S, D), or,
with positions (B, S) int64, one (1, P, D) table that each token reads at its position (packed
rows: one table for every row instead of a (B, S, D) copy that lives through the backward).
Outputs q (B, H, S, D), k and v (B, G, S, D): attention's layout, stored as (B, S, heads, D)
rows (the strides Hugging Face's transposed views have). The backward writes dq, dk, dv
un-rotated into one packed (B, S, (H + 2G)·D) gradient, with no slice or concat copies.

Per family: tables of R < D dims rotate only the first R of each head (partial rotary); a
`HeadNorm` normalises q and k per head first (Qwen3, Gemma 3), which keeps the input qkv for the
backward (the norm's gradient needs it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gpu_kernels import _lib
from gpu_kernels.ops.rope_reference import HeadNorm, rope_head_size, rotary_dims


def norm_fits(head_size: int, rotary: int) -> bool:
    """Whether the kernel's per-head norm covers this head: its reduction runs over the D/8
    threads of a head (D/2 when the pairs are not 4-aligned), a power of two of at most 32."""
    vec = (rotary // 2) % 4 == 0 and ((head_size - rotary) // 2) % 4 == 0
    groups = head_size // (8 if vec else 2)
    return 1 <= groups <= 32 and groups & (groups - 1) == 0


def _bshd(b: int, s: int, heads: int, d: int, like: torch.Tensor) -> torch.Tensor:
    """An empty (B, heads, S, D) tensor laid out as (B, S, heads, D) rows (not a view)."""
    strides = (s * heads * d, d, heads * d, 1)
    return torch.empty_strided((b, heads, s, d), strides, dtype=like.dtype, device=like.device)


def _tables(
    cos: torch.Tensor, sin: torch.Tensor, like: torch.Tensor, positions: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as contiguous tables of like's dtype, shapes checked: (1 or B, S, R), or
    (1, P, R) read by position when positions are given."""
    b, s, _ = like.shape
    shapes = f"{tuple(cos.shape)} and {tuple(sin.shape)}"
    if cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(f"cos/sin must be two 3-d tables of one shape, got {shapes}")
    if positions is None and (cos.shape[0] not in (1, b) or cos.shape[1] != s):
        raise ValueError(f"cos/sin must both be (1 or {b}, {s}, R), got {shapes}")
    if positions is not None and cos.shape[0] != 1:
        raise ValueError(f"cos/sin read by position must both be (1, P, R), got {shapes}")
    return cos.to(like.dtype).contiguous(), sin.to(like.dtype).contiguous()


def _positions(positions: torch.Tensor | None, b: int, s: int) -> torch.Tensor | None:
    """positions as a contiguous (B, S) int64 tensor, shape checked; None stays None."""
    if positions is None:
        return None
    if positions.shape != (b, s):
        raise ValueError(f"positions must be ({b}, {s}), got {tuple(positions.shape)}")
    return positions.to(torch.int64).contiguous()


@dataclass(frozen=True)
class RopeCall:
    """One rope_qkv call, checked and ready to launch: its tables, positions and norm weights
    (tensors an autograd op saves for the backward) and its sizes. `rotate` writes q/k/v from the
    projected rows, `unrotate` the packed gradient; the backward of a recomputing op (see
    gpu_kernels.ops.rope_attention) can rotate again from the same rows, bit for bit."""

    cos: torch.Tensor  # (1 or B, S, R), or (1, P, R) read by position
    sin: torch.Tensor
    pos: torch.Tensor | None  # (B, S) int64
    qw: torch.Tensor | None  # (D,) q/k norm weights, in the rows' dtype; None: no norm
    kw: torch.Tensor | None
    sizes: tuple[int, int, int, int, int, int, int, int]  # B, S, H, G, D, R, cos strides (batch, seq)
    eps: float
    offset: float

    @classmethod
    def of(
        cls,
        x: torch.Tensor,  # (B, S, (H + 2G)·D), contiguous
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        n_heads: int,
        n_kv: int,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        offset: float,
    ) -> RopeCall:
        b, s, width = x.shape
        d = rope_head_size(width, n_heads, n_kv)
        r = rotary_dims(cos, sin, d)
        if d % 2:
            raise ValueError(f"head size {d} must be even")
        cos, sin = _tables(cos, sin, x, positions)
        cs_b = cos.stride(0) if cos.shape[0] > 1 else 0  # 0: one table broadcast over the batch
        qw = kw = None
        if q_weight is not None and k_weight is not None:
            qw, kw = (w.to(x.dtype).contiguous() for w in (q_weight, k_weight))
        sizes = (b, s, n_heads, n_kv, d, r, cs_b, cos.stride(1))
        return cls(cos, sin, _positions(positions, b, s), qw, kw, sizes, float(eps), float(offset))

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """What an autograd op saves for the backward (save_for_backward, so offload hooks see
        them); `meta()` is the rest, and `restored` puts the two together again."""
        return self.cos, self.sin, self.pos, self.qw, self.kw

    def meta(self) -> tuple[tuple[int, int, int, int, int, int, int, int], float, float]:
        return self.sizes, self.eps, self.offset

    @classmethod
    def restored(cls, tensors: Sequence[torch.Tensor | None], meta: tuple[Any, float, float]) -> RopeCall:
        cos, sin, pos, qw, kw = tensors
        assert cos is not None and sin is not None
        return cls(cos, sin, pos, qw, kw, *meta)

    def rotate(
        self, x: torch.Tensor, v_in_place: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, S, D), k and v (B, G, S, D), stored as (B, S, heads, D) rows, from x. With
        `v_in_place`, v is a view of x's v heads (row stride (H + 2G)·D), not a copy: for a caller
        that keeps x alive anyway (flash attention takes any row stride)."""
        b, s, n_heads, n_kv, d, r, cs_b, cs_s = self.sizes
        q, k = _bshd(b, s, n_heads, d, x), _bshd(b, s, n_kv, d, x)
        if v_in_place:  # (B, S, H + 2G, D) rows -> their last G heads as (B, G, S, D)
            v = x.view(b, s, n_heads + 2 * n_kv, d)[:, :, n_heads + n_kv :].transpose(1, 2)
        else:
            v = _bshd(b, s, n_kv, d, x)
        rc = _lib.load().loraq_rope_fwd(
            x.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), _lib.ptr(self.pos), cs_b, cs_s,
            q.data_ptr(), k.data_ptr(), None if v_in_place else v.data_ptr(), _lib.ptr(self.qw),
            _lib.ptr(self.kw), self.eps, self.offset, _lib.dtype_code(x.dtype), b, s, n_heads, n_kv, d, r,
            _lib.stream(x.device),
        )  # fmt: skip
        _lib.check(rc, "loraq_rope_fwd")
        return q, k, v

    def unrotate(
        self,
        x: torch.Tensor | None,
        dq: torch.Tensor | None,
        dk: torch.Tensor | None,
        dv: torch.Tensor | None,
    ) -> torch.Tensor:
        """The packed gradient (B, S, (H + 2G)·D) from dq/dk/dv in any (B, heads, S, D) strides
        (None: zero); x, the rows as projected, only where the call normalises q and k."""
        b, s, n_heads, n_kv, d, r, cs_b, cs_s = self.sizes
        dtype, device = self.cos.dtype, self.cos.device
        grads = []
        for g, heads in ((dq, n_heads), (dk, n_kv), (dv, n_kv)):
            if g is None:
                g = torch.zeros(b, heads, s, d, dtype=dtype, device=device)
            if g.dtype != dtype:
                g = g.to(dtype)
            if g.stride(-1) != 1:
                g = g.contiguous()
            grads.append(g)
        gq, gk, gv = grads
        dqkv = torch.empty(b, s, (n_heads + 2 * n_kv) * d, dtype=dtype, device=device)
        rc = _lib.load().loraq_rope_bwd(
            gq.data_ptr(), gq.stride(0), gq.stride(1), gq.stride(2),
            gk.data_ptr(), gk.stride(0), gk.stride(1), gk.stride(2),
            gv.data_ptr(), gv.stride(0), gv.stride(1), gv.stride(2),
            self.cos.data_ptr(), self.sin.data_ptr(), _lib.ptr(self.pos), cs_b, cs_s, _lib.ptr(x),
            _lib.ptr(self.qw), _lib.ptr(self.kw), self.eps, self.offset, dqkv.data_ptr(),
            _lib.dtype_code(dtype), b, s, n_heads, n_kv, d, r, _lib.stream(device),
        )  # fmt: skip
        _lib.check(rc, "loraq_rope_bwd")
        return dqkv


class RoPEQKVFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor | None,
        n_heads: int,
        n_kv: int,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        offset: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = qkv.contiguous()
        call = RopeCall.of(x, cos, sin, positions, n_heads, n_kv, q_weight, k_weight, eps, offset)
        q, k, v = call.rotate(x)
        # the norm's backward reads its input: q/k/v as projected (B, S, (H + 2G)·D)
        ctx.save_for_backward(x if call.qw is not None else None, *call.tensors())
        ctx.meta = call.meta()
        return q, k, v

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None) -> Any:
        x, *tensors = ctx.saved_tensors
        dqkv = RopeCall.restored(tensors, ctx.meta).unrotate(x, dq, dk, dv)
        return dqkv, None, None, None, None, None, None, None, None, None


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    positions: torch.Tensor | None = None,  # (B, S); every entry < P, the tables' length
    norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qw, kw, eps, offset = norm if norm is not None else (None, None, 0.0, 0.0)
    q, k, v = RoPEQKVFunction.apply(qkv, cos, sin, positions, n_heads, n_kv_heads, qw, kw, eps, offset)
    return q, k, v
