"""Fused LoRA linear on the GPU, forward and backward, for one projection or several that share
their input (q/k/v, gate/up).

Shapes: x (M, K) after flattening the leading dims; W (N, K) with N = Σ N_j the stacked
projections; A_j (r_j, K), B_j (N_j, r_j), scale s_j; R = Σ r_j.

forward   xa = drop(x)·[A_1; A_2; ...]ᵀ          one skinny GEMM for every adapter, (M, R)
          y  = xa·D (+ b)                        D = blockdiag(s_j·B_jᵀ) (R, N): the LoRA term
          y += x·Wᵀ                              base GEMM with beta = 1, in place, (M, N)
backward  U  = dY·Dᵀ = [s_1·dY_1·B_1 | ...]      (M, R), one GEMM for every adapter
          dX = U·[A_1; A_2; ...]                 (M, K)
          dX += dY·W                             base GEMM with beta = 1: one buffer for dX
          dA = Uᵀ·drop(x)  (R, K);  dB_j = s_j·dY_jᵀ·xa_j  (N_j, r_j)   cheap order, from saved xa
          (x an RMSNorm's output, given its NormSource, no dropout: dA from the norm's input and
          rstd, and x is not kept: gpu_kernels/ops/norm_source.py)

A compact frozen base (NF4, int8, GGML blocks: gpu_kernels.quant) runs the two base GEMMs over its
dequantized tiles, each tile's product written into (or added onto) its columns of y and dX
(gpu_kernels.quant.frozen.linear_into / input_grad_into): the same op for a QLoRA step.

Dropout on the LoRA input (p > 0, training) uses csrc's hash mask: the backward regenerates
drop(x) from x, the device seed saved at forward time and the call's salt. With p = 0 the
skinny GEMM reads x itself (no copy).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch

from gpu_kernels import _lib
from gpu_kernels.ops.norm_source import NormSource, lora_input_grad
from gpu_kernels.quant.frozen import (
    FrozenWeight,
    base_linear,
    input_grad_into,
    linear_into,
    save_weights,
    saved_weights,
)

_MAX_RANK_PER_LAUNCH = 16
# How the LoRA term meets the base GEMM's output:
# - "epilogue" (default): the skinny GEMM writes the LoRA term first and the base GEMM adds into
#   it with beta = 1, so the full-size output is read inside the compute-bound GEMM's epilogue
#   instead of by a separate memory-bound pass (which reads and writes all of it once more).
# - "cublas": base GEMM first, then a rank-r cuBLAS GEMM with beta = 1 in place (addmm_).
# - "kernel": base GEMM first, then our rank-update kernel (csrc/lora.cu, fp32 V). On an H100
#   (M8192 N2048 r16, bf16) cuBLAS took 40 us, ours 76 us.
# Adapter matrices are rounded to the activation dtype, as PEFT's autocast does.
# `set_rank_update` (gpu_kernels.configure; a worker passes LORAQ_RANK_UPDATE) picks another.
RankUpdate = Literal["epilogue", "cublas", "kernel"]
_RANK_UPDATE: RankUpdate = "epilogue"
_salts = itertools.count(1)
_seeds: dict[torch.device, torch.Tensor] = {}


def set_rank_update(order: RankUpdate) -> None:
    global _RANK_UPDATE
    if order not in get_args(RankUpdate):
        raise ValueError(f"rank_update must be 'epilogue', 'cublas' or 'kernel', not {order!r}")
    _RANK_UPDATE = order


def get_rank_update() -> RankUpdate:
    return _RANK_UPDATE


def dropout_seed(device: torch.device) -> torch.Tensor:
    """The device's dropout seed (int64 0-d on the device). Bump it once per step with
    next_dropout_seed_ so a replayed CUDA graph draws new masks."""
    if device not in _seeds:
        _seeds[device] = torch.zeros((), dtype=torch.int64, device=device)
    return _seeds[device]


def next_dropout_seed_(device: torch.device) -> None:
    dropout_seed(device).add_(1)


def dropout(x: torch.Tensor, p: float, seed: torch.Tensor, salt: int) -> torch.Tensor:
    """x ⊙ keep(seed, salt, i) / (1 − p) for contiguous CUDA x."""
    out = torch.empty_like(x)
    rc = _lib.load().loraq_dropout(
        x.data_ptr(), out.data_ptr(), _lib.dtype_code(x.dtype), x.numel(), float(p),
        seed.data_ptr(), salt & 0xFFFFFFFF, _lib.stream(x.device),
    )  # fmt: skip
    _lib.check(rc, "loraq_dropout")
    return out


def rank_update_(
    out: torch.Tensor,
    col: int,
    n_cols: int,
    u: torch.Tensor,
    u_col: int,
    r_total: int,
    v: torch.Tensor,
    scale: float,
) -> None:
    """out[:, col:col+n_cols] += scale · u[:, u_col:u_col+r_total] · v, in place.

    out (M, ld) row-major, bf16 or fp32; u (M, ≥ u_col + r_total) of out's dtype with unit column
    stride; v (r_total, n_cols) in the adapters' dtype, any strides (Bᵀ in the forward, A in the
    backward). Ranks above 16 are split over several launches."""
    if _RANK_UPDATE == "cublas":  # cuBLAS GEMM with beta = 1, in place on the strided slice
        # one cast kernel; cuBLAS reads a transposed v as it is
        out[:, col : col + n_cols].addmm_(u[:, u_col : u_col + r_total], v.to(out.dtype), alpha=scale)
        return
    v = v.float().contiguous()  # our kernel reads fp32 rows
    lib = _lib.load()
    m, ld = out.shape
    elt = out.element_size()
    ldu = u.stride(0)
    for r0 in range(0, r_total, _MAX_RANK_PER_LAUNCH):
        r = min(_MAX_RANK_PER_LAUNCH, r_total - r0)
        rc = lib.loraq_rank_update(
            out.data_ptr() + elt * col, _lib.dtype_code(out.dtype), ld, m, n_cols,
            u.data_ptr() + elt * (u_col + r0), ldu, v.data_ptr() + 4 * r0 * n_cols, n_cols, r, float(scale),
            _lib.stream(out.device),
        )  # fmt: skip
        _lib.check(rc, "loraq_rank_update")


def _scaled_block_diag(
    b_list: Sequence[torch.Tensor], scales: Sequence[float], dtype: torch.dtype
) -> torch.Tensor:
    """D = blockdiag(s_1·B_1ᵀ, s_2·B_2ᵀ, ...) (R, N) in dtype: xa·D is every adapter's LoRA term
    side by side, and dY·Dᵀ every adapter's s_j·dY_j·B_j. One scale-and-cast kernel per adapter."""
    ranks = [b.shape[1] for b in b_list]
    widths = [b.shape[0] for b in b_list]
    make = torch.empty if len(b_list) == 1 else torch.zeros
    d = make(sum(ranks), sum(widths), dtype=dtype, device=b_list[0].device)
    col = r0 = 0
    for b, s, r, n in zip(b_list, scales, ranks, widths, strict=True):
        torch.mul(b.detach().t(), s, out=d[r0 : r0 + r, col : col + n])
        col += n
        r0 += r
    return d


def cast_operands(
    a_list: Sequence[torch.Tensor],
    b_list: Sequence[torch.Tensor],
    scales: Sequence[float],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A_cat = [A_1; A_2; ...] (R, K) and D = blockdiag(s_j·B_jᵀ) (R, N) in `dtype`, built in the
    call (a cat, a cast and a scale per adapter): what an AdapterCasts holds inside a step."""
    a_cat = torch.cat(list(a_list)) if len(a_list) > 1 else a_list[0]  # (R, K)
    return a_cat.detach().to(dtype), _scaled_block_diag(b_list, scales, dtype)


def _accumulates_in_epilogue(
    a: torch.Tensor, weight: torch.Tensor | FrozenWeight, bias: torch.Tensor | None = None
) -> bool:
    """Whether the base GEMM can add into the LoRA term in place: the "epilogue" mode, and the
    GEMM runs in the operands' own dtype (no autocast cast, which addmm_ does not do)."""
    if _RANK_UPDATE != "epilogue" or a.dtype != weight.dtype or (bias is not None and bias.dtype != a.dtype):
        return False
    kind = a.device.type
    return not torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) == a.dtype


class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | FrozenWeight,  # a frozen compact one (NF4, ...): GEMMs over its tiles
        bias: torch.Tensor | None,
        scales: tuple[float, ...],
        dropout_p: float,
        operands: tuple[torch.Tensor, torch.Tensor] | None,
        source: NormSource | None,
        *adapters: torch.Tensor,  # A_1, B_1, A_2, B_2, ...
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        k = x.shape[-1]
        x2 = x.reshape(-1, k).contiguous()
        a_list = list(adapters[0::2])
        b_list = list(adapters[1::2])
        ranks = [a.shape[0] for a in a_list]
        widths = [b.shape[0] for b in b_list]
        n_total = weight.shape[0]
        if sum(widths) != n_total:
            raise ValueError(f"adapters cover {sum(widths)} output features but weight has {n_total}")

        seed = salt = None
        xd = x2
        if dropout_p > 0:
            seed = dropout_seed(x.device).clone()  # snapshot: the backward must see the same mask
            salt = next(_salts)
            xd = dropout(x2, dropout_p, seed, salt)

        # adapters in the activation dtype, kept for the backward: A (R, K) and
        # D = blockdiag(s_j·B_jᵀ) (R, N), the scales folded in; from an AdapterCasts refreshed
        # since the last optimizer step, or cast here (a cat, a cast and a scale per adapter)
        a_act, d_act = operands if operands is not None else cast_operands(a_list, b_list, scales, x.dtype)
        xa = xd @ a_act.t()  # (M, R): one read of x for every adapter
        if _accumulates_in_epilogue(x2, weight, bias):
            y = torch.addmm(bias, xa, d_act) if bias is not None else xa @ d_act  # (M, N) LoRA term
            linear_into(y, x2, weight, add=True)  # + x·Wᵀ, beta = 1
        else:
            y = base_linear(x2, weight, bias)  # (M, N)
            col = r0 = 0
            for r, n in zip(ranks, widths, strict=True):
                rank_update_(y, col, n, xa, r0, r, d_act[r0 : r0 + r, col : col + n], 1.0)
                col += n
                r0 += r

        # x is a norm's output and only dA reads it: keep the norm's own tensors instead (x dies)
        kept = source if source is not None and dropout_p == 0 and not ctx.needs_input_grad[1] else None
        x_kept, rstd, norm_w = kept.tensors() if kept is not None else (x2, None, None)
        ctx.save_for_backward(
            x_kept, *save_weights(ctx, weight), xa, seed, a_act, d_act, rstd, norm_w, *adapters
        )
        ctx.meta = (lead, scales, dropout_p, salt, ranks, widths, bias is not None)
        ctx.norm_offset = kept.offset if kept is not None else 0.0
        return y.view(*lead, n_total)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lead, scales, dropout_p, salt, ranks, widths, has_bias = ctx.meta
        x2, dense, xa, seed, a_act, d_act, rstd, norm_w, *adapters = ctx.saved_tensors
        (weight,) = saved_weights(ctx, dense)
        a_list = adapters[0::2]
        b_list = adapters[1::2]
        n_total, k = weight.shape
        dy2 = dy.reshape(-1, n_total).contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]

        u = dy2 @ d_act.t()  # (M, R) = [s_j · dY_j · B_j], one GEMM for every adapter
        r_total = u.shape[1]

        dx = None
        if need_x:
            epilogue = _accumulates_in_epilogue(dy2, weight)
            if dropout_p == 0 and not epilogue:
                dx = input_grad_into(None, dy2, weight)  # (M, K)
                rank_update_(dx, 0, k, u, 0, r_total, a_act, 1.0)  # A (R, K)
            else:
                dx = u @ a_act  # (M, K) LoRA term
                if dropout_p > 0:
                    # d/dx of drop(x)·Aᵀ is mask/(1-p) ⊙ (U·A): mask it like the forward
                    dx = dropout(dx, dropout_p, seed, salt)
                if epilogue:
                    input_grad_into(dx, dy2, weight)  # + dY·W, beta = 1
                else:
                    dx += input_grad_into(None, dy2, weight)
            dx = dx.view(*lead, k)

        grads_ad: list[torch.Tensor | None] = []
        if rstd is not None:  # x2 is the norm's input: dA from it, rstd and the norm's weight
            da_cat = lora_input_grad(u, x2, rstd, norm_w, ctx.norm_offset).to(a_list[0].dtype)
        else:
            xd = x2 if dropout_p == 0 else dropout(x2, dropout_p, seed, salt)
            da_cat = (u.t() @ xd).to(a_list[0].dtype)  # (R, K); rows of adapter j are a contiguous slice
        # dB_j = s_j·dY_jᵀ·xa_j is block j of G = dYᵀ·xa (N, R): one skinny GEMM (and one split-K
        # reduction) for every adapter instead of one each; the off-diagonal blocks are waste,
        # but tiny next to reading dY
        g = dy2.t() @ xa  # (N, R)
        col = r0 = 0
        for j, (a, b, r, n, s) in enumerate(zip(a_list, b_list, ranks, widths, scales, strict=True)):
            # inputs are (x, weight, bias, scales, dropout_p, operands, source, A_1, B_1, ...): A_j at 7 + 2j
            need_a, need_b_j = ctx.needs_input_grad[7 + 2 * j], ctx.needs_input_grad[8 + 2 * j]
            da = da_cat[r0 : r0 + r].to(a.dtype) if need_a else None
            db = None
            if need_b_j:  # scaled and cast into the factor's dtype by one kernel
                db = torch.mul(g[col : col + n, r0 : r0 + r], s, out=torch.empty_like(b))  # (N_j, r_j)
            grads_ad.extend([da, db])
            col += n
            r0 += r

        dw = dy2.t() @ x2 if need_w else None  # never with a NormSource (kept only when W is frozen)
        dbias = dy2.sum(0) if (has_bias and need_b) else None
        return (dx, dw, dbias, None, None, None, None, *grads_ad)


def lora_linear_grouped(
    x: torch.Tensor,
    weight: torch.Tensor | FrozenWeight,
    bias: torch.Tensor | None,
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]],
    dropout_p: float = 0.0,
    training: bool = False,
    operands: tuple[torch.Tensor, torch.Tensor] | None = None,
    source: NormSource | None = None,
) -> torch.Tensor:
    """`operands`: (A_cat, D) in x's dtype from an AdapterCasts refreshed since the factors
    last changed, or None to cast them in this call. `source`: x is that norm's output
    (gpu_kernels.ops.norm_source): the backward forms dA from the norm's tensors, x is not kept."""
    p = dropout_p if training else 0.0
    flat = [t for a, b, _ in adapters for t in (a, b)]
    scales = tuple(float(s) for _, _, s in adapters)
    out = LoRALinearFunction.apply(x, weight, bias, scales, p, operands, source, *flat)
    assert isinstance(out, torch.Tensor)
    return out


def lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor | FrozenWeight,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    dropout_p: float = 0.0,
    training: bool = False,
) -> torch.Tensor:
    return lora_linear_grouped(x, weight, bias, [(lora_a, lora_b, scale)], dropout_p, training)
