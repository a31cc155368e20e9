"""RMSNorm and the gated MLP activation on the GPU (csrc/norm_act.cu), forward and backward.

RMSNorm scales by (offset + w): offset 0 for Llama-style weights (initialised at 1), 1 for
Gemma's (initialised at 0). The gated activation is SiLU (SwiGLU) or tanh-approximated GELU
(GeGLU, Gemma); `swiglu*` keep their name for both.

RMSNorm's weight is frozen in LoRA training; if it does require grad, its gradient is formed
with plain torch from the saved rstd (rare path, kept correct rather than fast).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_kernels import _lib
from gpu_kernels.ops.norm_act_reference import Activation

# activation codes of csrc/norm_act.cu
ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu_tanh": 1}


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
        d = x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()  # (M, D)
        w = weight.to(x.dtype).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)  # (M,)
        rc = _lib.load().loraq_rmsnorm_fwd(
            x2.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), _lib.dtype_code(x.dtype),
            x2.shape[0], d, float(eps), float(offset), _lib.stream(x.device),
        )  # fmt: skip
        _lib.check(rc, "loraq_rmsnorm_fwd")
        ctx.save_for_backward(x2, w, rstd)
        ctx.offset = float(offset)
        ctx.shape = x.shape
        ctx.weight_dtype = weight.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape).contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x2)
            rc = _lib.load().loraq_rmsnorm_bwd(
                dy2.data_ptr(), x2.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                _lib.dtype_code(x2.dtype), x2.shape[0], x2.shape[1], ctx.offset, _lib.stream(x2.device),
            )  # fmt: skip
            _lib.check(rc, "loraq_rmsnorm_bwd")
            dx = dx.view(ctx.shape)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = (dy2.float() * x2.float() * rstd[:, None]).sum(0).to(ctx.weight_dtype)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    out = RMSNormFunction.apply(x, weight, eps, offset)
    assert isinstance(out, torch.Tensor)
    return out


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """t as (M, F) with unit column stride and its row stride, copying only if it must."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < t2.shape[1]):
        t2 = t2.contiguous()
    return t2, t2.stride(0) if t2.shape[0] > 1 else t2.shape[1]


def _swiglu_fwd(g2: torch.Tensor, ldg: int, u2: torch.Tensor, ldu: int, act: int) -> torch.Tensor:
    m, f = g2.shape
    h = torch.empty((m, f), dtype=g2.dtype, device=g2.device)
    rc = _lib.load().loraq_swiglu_fwd(
        g2.data_ptr(), ldg, u2.data_ptr(), ldu, h.data_ptr(), _lib.dtype_code(g2.dtype), m, f, act,
        _lib.stream(g2.device),
    )  # fmt: skip
    _lib.check(rc, "loraq_swiglu_fwd")
    return h


def _swiglu_bwd(
    dh: torch.Tensor, g2: torch.Tensor, ldg: int, u2: torch.Tensor, ldu: int,
    dg: torch.Tensor, lddg: int, du: torch.Tensor, lddu: int, act: int,
) -> None:  # fmt: skip
    m, f = g2.shape
    rc = _lib.load().loraq_swiglu_bwd(
        dh.data_ptr(), g2.data_ptr(), ldg, u2.data_ptr(), ldu, dg.data_ptr(), lddg, du.data_ptr(), lddu,
        _lib.dtype_code(g2.dtype), m, f, act, _lib.stream(g2.device),
    )  # fmt: skip
    _lib.check(rc, "loraq_swiglu_bwd")


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
        g2, ldg = _rows(gate)
        u2, ldu = _rows(up)
        h = _swiglu_fwd(g2, ldg, u2, ldu, act)
        ctx.save_for_backward(g2, u2)
        ctx.lds = (ldg, ldu)
        ctx.act = act
        ctx.shape = gate.shape
        return h.view(gate.shape)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        g2, u2 = ctx.saved_tensors
        ldg, ldu = ctx.lds
        m, f = g2.shape
        dh2 = dh.reshape(m, f).contiguous()
        dg = torch.empty((m, f), dtype=g2.dtype, device=g2.device)
        du = torch.empty_like(dg)
        _swiglu_bwd(dh2, g2, ldg, u2, ldu, dg, f, du, f, ctx.act)
        return dg.view(ctx.shape), du.view(ctx.shape), None


class SwiGLUPackedFunction(torch.autograd.Function):
    """Input (..., 2F) = [gate | up]; its gradient is written as one (M, 2F) buffer, which is
    what the grouped gate/up LoRA backward wants (no concatenation copy)."""

    @staticmethod
    def forward(ctx: Any, gate_up: torch.Tensor, act: int) -> torch.Tensor:
        two_f = gate_up.shape[-1]
        if two_f % 2:
            raise ValueError(f"swiglu_packed wants an even last dim, got {two_f}")
        f = two_f // 2
        gu = gate_up.reshape(-1, two_f).contiguous()  # (M, 2F)
        h = _swiglu_fwd(gu[:, :f], two_f, gu[:, f:], two_f, act)
        ctx.save_for_backward(gu)
        ctx.act = act
        ctx.shape = gate_up.shape
        return h.view(*gate_up.shape[:-1], f)

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor, None]:
        (gu,) = ctx.saved_tensors
        m, two_f = gu.shape
        f = two_f // 2
        dh2 = dh.reshape(m, f).contiguous()
        dgu = torch.empty_like(gu)
        _swiglu_bwd(dh2, gu[:, :f], two_f, gu[:, f:], two_f, dgu[:, :f], two_f, dgu[:, f:], two_f, ctx.act)
        return dgu.view(ctx.shape), None


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
    out = SwiGLUFunction.apply(gate, up, ACTIVATIONS[activation])
    assert isinstance(out, torch.Tensor)
    return out


def swiglu_packed(gate_up: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
    out = SwiGLUPackedFunction.apply(gate_up, ACTIVATIONS[activation])
    assert isinstance(out, torch.Tensor)
    return out
