"""A decoder layer's residual add fused with the RMSNorm that reads the sum (csrc/residual_norm.cu),
forward and backward: (h, norm(h)) with h = residual + delta, or residual + norm_p(delta) with
Gemma's sandwich norms. The values are those of the separate norm, add and norm ops (each
intermediate rounded where they round it); the backward sums the gradient arriving on h with the
norm's in fp32 and rounds once, where autograd rounds the norm's gradient first.

Shapes: residual, delta (..., D), weights (D,), frozen (their gradient is not formed: LoRA
training freezes every norm; gpu_kernels.dispatch sends a trainable weight to the reference).

`keep_sum=False` (sandwich only): the backward forms h again from the residual and delta, bit for
bit, instead of keeping h. Where the residual is kept anyway (the stream the step before keeps for
its own norm) and delta too (the sandwich's norm reads it), that is one (M, D) tensor less.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_kernels import _lib
from gpu_kernels.ops.norm_source import NormSource
from gpu_kernels.ops.residual_norm_reference import DeltaNorm


def _keeps_sum(delta_weight: torch.Tensor | None, keep_sum: bool) -> bool:
    """Whether the op keeps h: always but with a sandwich norm whose sum is formed again."""
    return keep_sum or delta_weight is None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        residual: torch.Tensor,
        delta: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        delta_weight: torch.Tensor | None,
        delta_eps: float,
        keep_sum: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = residual.shape[-1]
        r, y = (t.reshape(-1, d).contiguous() for t in (residual, delta))  # (M, D)
        w = weight.to(r.dtype).contiguous()
        wp = delta_weight.to(r.dtype).contiguous() if delta_weight is not None else None
        h, n = torch.empty_like(r), torch.empty_like(r)
        rstd = torch.empty(r.shape[0], dtype=torch.float32, device=r.device)  # (M,)
        rstd_p = torch.empty_like(rstd) if wp is not None else None
        rc = _lib.load().loraq_add_rmsnorm_fwd(
            r.data_ptr(), y.data_ptr(), _lib.ptr(wp), w.data_ptr(), h.data_ptr(), n.data_ptr(),
            rstd.data_ptr(), _lib.ptr(rstd_p), _lib.dtype_code(r.dtype), r.shape[0], d, float(delta_eps),
            float(eps), float(offset), _lib.stream(r.device),
        )  # fmt: skip
        _lib.check(rc, "loraq_add_rmsnorm_fwd")
        # the norm's backward reads h (or forms it from r and y); the sandwich's first norm reads
        # delta (what a separate norm on delta would keep too)
        recompute = not _keeps_sum(wp, keep_sum)
        ctx.save_for_backward(
            None if recompute else h,
            r if recompute else None,
            w,
            rstd,
            y if wp is not None else None,
            wp,
            rstd_p,
        )
        ctx.offset = float(offset)
        ctx.shape = residual.shape
        ctx.set_materialize_grads(False)  # an unused sum (the last layer's) sends None, not zeros
        ctx.mark_non_differentiable(rstd)
        return h.view(residual.shape), n.view(residual.shape), rstd

    @staticmethod
    def backward(ctx: Any, dh_in: torch.Tensor | None, dn: torch.Tensor | None, _: Any) -> Any:
        h, r, w, rstd, y, wp, rstd_p = ctx.saved_tensors
        like = h if h is not None else r  # (M, D)
        dn2 = dn.reshape(like.shape).contiguous() if dn is not None else torch.zeros_like(like)
        dr = dh_in.reshape(like.shape).contiguous() if dh_in is not None else None
        dh = torch.empty_like(like)
        dy = torch.empty_like(like) if wp is not None else None
        rc = _lib.load().loraq_add_rmsnorm_bwd(
            _lib.ptr(dr), dn2.data_ptr(), _lib.ptr(h), _lib.ptr(r), w.data_ptr(), rstd.data_ptr(),
            _lib.ptr(y), _lib.ptr(wp), _lib.ptr(rstd_p), dh.data_ptr(), _lib.ptr(dy),
            _lib.dtype_code(like.dtype), like.shape[0], like.shape[1], ctx.offset, _lib.stream(like.device),
        )  # fmt: skip
        _lib.check(rc, "loraq_add_rmsnorm_bwd")
        d_delta = dy if dy is not None else dh
        return dh.view(ctx.shape), d_delta.view(ctx.shape), None, None, None, None, None, None


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    delta_norm: DeltaNorm | None = None,
    keep_sum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, NormSource | None]:
    """(h, n, n's NormSource): the source where the op keeps h (not with keep_sum=False and a
    sandwich norm), so LoRA ops reading n can keep h and rstd, which the op keeps anyway."""
    wp, eps_p = delta_norm if delta_norm is not None else (None, 0.0)
    h, n, rstd = AddRMSNormFunction.apply(residual, delta, weight, eps, offset, wp, eps_p, keep_sum)
    kept = _keeps_sum(wp, keep_sum)
    source = NormSource(h.detach().reshape(-1, h.shape[-1]), rstd, weight, offset) if kept else None
    return h, n, source
