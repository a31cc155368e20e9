"""The gated MLP y = down(act(gate(x)) ⊙ up(x)) with LoRA on gate, up and down, as one autograd
op whose backward folds the LoRA reductions into the activation's backward (csrc/lora_mlp.cu).

Shapes: x (M, K); W_gu (2F, K) = [W_g; W_u]; W_d (Kd, F); A_g, A_u (16, K), B_g, B_u (F, 16);
A_d (16, F), B_d (Kd, 16). Operands in the activation dtype, scales folded into D:
A_gu = [A_g; A_u] (32, K), D_gu = blockdiag(s_g·B_gᵀ, s_u·B_uᵀ) (32, 2F); A_d, D_d = s_d·B_dᵀ.

forward   xa = x·A_guᵀ (M, 32);  gu = xa·D_gu + x·W_guᵀ (M, 2F)      as LoRALinearFunction
          h = act(g) ⊙ u (M, F)                                       freed, not saved
          xd = h·A_dᵀ (M, 16);   y = xd·D_d + h·W_dᵀ (M, Kd)
backward  U_d = dY·D_dᵀ (M, 16); dB_d = s_d·dYᵀ·xd; dh = U_d·A_d + dY·W_d
          kernel: dgu = [dh⊙u⊙act'(g) | dh⊙act(g)], and from the same tile
                  U = dgu·D_guᵀ (M, 32), G = [dgᵀ·xa_g; duᵀ·xa_u] (2F, 16), dA_d = U_dᵀ·h (16, F)
          dX = U·A_gu + dgu·W_gu; dA_gu = Uᵀ·x; dB_g = s_g·G_g, dB_u = s_u·G_u
          (x an RMSNorm's output, given its NormSource: dA_gu from the norm's input and rstd,
          and x is not kept: gpu_kernels/ops/norm_source.py)

The unfused path reads dgu three times and a saved h once; this one reads dgu once and saves no
h: about 2·(M, 2F) + (M, F) fewer bytes read, and (M, F) less activation memory, per layer.
It serves bf16 activations, adapters of rank 16 or less on all three projections (under 16
padded with zeros; gate and up as two adapters, or one over the packed [gate | up] as Phi-3's
gate_up_proj has it), no dropout and no biases (`fusable`), on a dense or a compact frozen base
(a QLoRA step: its four base GEMMs over the dequantized tiles, gpu_kernels.quant.frozen); anything
else takes the composed ops (LoRALinearFunction, swiglu_packed).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_kernels import _lib
from gpu_kernels.ops.lora import _accumulates_in_epilogue, cast_operands
from gpu_kernels.ops.norm_act import ACTIVATIONS, _swiglu_fwd
from gpu_kernels.ops.norm_act_reference import Activation
from gpu_kernels.ops.norm_source import NormSource, lora_input_grad
from gpu_kernels.quant.frozen import FrozenWeight, input_grad_into, linear_into, save_weights, saved_weights

RANK = 16  # the kernel's adapter rank (one tensor-core tile); smaller ranks are padded with zeros

Adapter = tuple[torch.Tensor, torch.Tensor, float]


def fusable(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | FrozenWeight,
    down_weight: torch.Tensor | FrozenWeight,
    gate_up: list[Adapter],
    down: list[Adapter],
) -> bool:
    """Whether the fused op serves this MLP (the caller has checked CUDA, the compiled library,
    no biases and no dropout; the weights dense or compact, computing in x's dtype). gate/up: two
    adapters of F outputs each, or one of 2F over the packed [gate | up] (Phi-3's gate_up_proj)."""
    if x.dtype != torch.bfloat16 or gate_up_weight.dtype != x.dtype or down_weight.dtype != x.dtype:
        return False
    if len(gate_up) not in (1, 2) or len(down) != 1:
        return False
    f = down_weight.shape[1]
    if gate_up_weight.shape[0] != 2 * f or f % 8 or x.shape[-1] % 8:
        return False
    ranks_ok = all(a.shape[0] <= RANK for a, _, _ in (*gate_up, *down))
    widths_ok = all(b.shape[0] == 2 * f // len(gate_up) for _, b, _ in gate_up)
    return ranks_ok and widths_ok and _accumulates_in_epilogue(x, gate_up_weight)


def _glu_bwd_lora(
    dh: torch.Tensor, gu: torch.Tensor, u_d: torch.Tensor, d_gu: torch.Tensor, xa: torch.Tensor, act: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dgu (M, 2F) bf16, U (M, 32) fp32, G (2F, 16) fp32, dA_d (16, F) fp32); see csrc/lora_mlp.cu."""
    m, f = dh.shape
    dgu = torch.empty_like(gu)
    u = torch.zeros((m, 2 * RANK), dtype=torch.float32, device=dh.device)
    g = torch.zeros((2 * f, RANK), dtype=torch.float32, device=dh.device)
    da = torch.zeros((RANK, f), dtype=torch.float32, device=dh.device)
    rc = _lib.load().loraq_glu_bwd_lora(
        dh.data_ptr(), gu.data_ptr(), u_d.data_ptr(), d_gu.data_ptr(), xa.data_ptr(), dgu.data_ptr(),
        u.data_ptr(), g.data_ptr(), da.data_ptr(), m, f, act, _lib.stream(dh.device),
    )  # fmt: skip
    _lib.check(rc, "loraq_glu_bwd_lora")
    return dgu, u, g, da


def _operands(
    adapters: list[Adapter], dtype: torch.dtype, cast: tuple[torch.Tensor, torch.Tensor] | None, packed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_cat, D) of one LoRA op in `dtype` in the kernel's layout, 16 rows an adapter: from `cast`
    (an AdapterCasts pair, ranks packed) or built here. Ranks under 16 are padded with zero rows,
    which add nothing to any product and get no gradient. `packed`: one adapter over [gate | up]
    (D (r, 2F)) becomes two, A twice and D's gate columns in rows 0-15, its up columns in rows
    16-31: x·Aᵀ·D is unchanged, and the kernel's two U halves add up to the one adapter's."""
    ranks = [a.shape[0] for a, _, _ in adapters]
    if cast is None:
        cast = cast_operands(
            [a for a, _, _ in adapters], [b for _, b, _ in adapters], [s for *_, s in adapters], dtype
        )
    a_cat, d = cast
    if packed:
        (r,) = ranks
        f = d.shape[1] // 2
        a_pad = a_cat.new_zeros((2 * RANK, a_cat.shape[1]))
        d_pad = d.new_zeros((2 * RANK, d.shape[1]))
        a_pad[:r] = a_cat
        a_pad[RANK : RANK + r] = a_cat
        d_pad[:r, :f] = d[:, :f]
        d_pad[RANK : RANK + r, f:] = d[:, f:]
        return a_pad, d_pad
    if all(r == RANK for r in ranks):
        return cast
    a_pad = a_cat.new_zeros((RANK * len(ranks), a_cat.shape[1]))
    d_pad = d.new_zeros((RANK * len(ranks), d.shape[1]))
    r0 = 0
    for j, r in enumerate(ranks):
        a_pad[RANK * j : RANK * j + r] = a_cat[r0 : r0 + r]
        d_pad[RANK * j : RANK * j + r] = d[r0 : r0 + r]
        r0 += r
    return a_pad, d_pad


class LoRAGatedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        w_gu: torch.Tensor | FrozenWeight,  # a frozen compact one (NF4, ...): GEMMs over its tiles
        w_d: torch.Tensor | FrozenWeight,
        act: int,
        scales: tuple[tuple[float, ...], float],
        operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        source: NormSource | None,
        *factors: torch.Tensor,  # gate/up's A_j, B_j (two adapters, or one packed), then A_d, B_d
    ) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, K)
        a_gu, d_gu, a_dn, d_dn = operands
        f = w_d.shape[1]
        xa = (x2 @ a_gu.t()).contiguous()  # (M, 32): [gate's 16 | up's 16], zero past a rank under 16
        gu = xa @ d_gu  # (M, 2F) LoRA term, then + x·W_guᵀ in the base GEMM's epilogue
        linear_into(gu, x2, w_gu, add=True)
        h = _swiglu_fwd(gu[:, :f], 2 * f, gu[:, f:], 2 * f, act)  # (M, F), not saved
        xd = (h @ a_dn.t()).contiguous()  # (M, 16)
        y = xd @ d_dn  # (M, Kd)
        linear_into(y, h, w_d, add=True)
        # x is a norm's output: keep the norm's own tensors for dA_gu instead (x dies here)
        x_kept, rstd, norm_w = source.tensors() if source is not None else (x2, None, None)
        dense = save_weights(ctx, w_gu, w_d)  # a frozen one is held on ctx
        ctx.save_for_backward(x_kept, *dense, xa, gu, xd, a_gu, d_gu, a_dn, d_dn, rstd, norm_w, *factors)
        ctx.meta = (lead, act, scales, source.offset if source is not None else 0.0)
        return y.view(*lead, w_d.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, dense_gu, dense_d, xa, gu, xd, a_gu, d_gu, a_dn, d_dn, rstd, norm_w, *factors = ctx.saved_tensors
        w_gu, w_d = saved_weights(ctx, dense_gu, dense_d)
        lead, act, (s_gu, s_d), norm_offset = ctx.meta
        f = w_d.shape[1]
        a_d, b_d = factors[-2:]
        r_d = a_d.shape[0]
        dy2 = dy.reshape(-1, w_d.shape[0]).contiguous()  # (M, Kd)
        u_d = (dy2 @ d_dn.t()).contiguous()  # (M, 16) = s_d·dY·B_d
        db_d = torch.mul((dy2.t() @ xd)[:, :r_d], s_d, out=torch.empty_like(b_d))  # (Kd, r_d)
        dh = u_d @ a_dn  # (M, F) LoRA term, then + dY·W_d
        input_grad_into(dh, dy2, w_d)
        dgu, u32, g32, da_d = _glu_bwd_lora(dh, gu, u_d, d_gu, xa, act)
        u = u32.to(x2.dtype)  # (M, 32)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = u @ a_gu  # (M, K) LoRA term, then + dgu·W_gu
            input_grad_into(dx, dgu, w_gu)
            dx = dx.view(*lead, x2.shape[1])
        # (32, K); with a NormSource x2 is the norm's input
        da_gu = lora_input_grad(u32, x2, rstd, norm_w, norm_offset) if rstd is not None else u.t() @ x2
        grads: list[torch.Tensor] = []
        if len(s_gu) == 2:  # gate, up
            (a_g, b_g, a_u, b_u), (r_g, r_u) = factors[:4], (factors[0].shape[0], factors[2].shape[0])
            grads += [da_gu[:r_g].to(a_g.dtype), torch.mul(g32[:f, :r_g], s_gu[0]).to(b_g.dtype)]
            grads += [da_gu[RANK : RANK + r_u].to(a_u.dtype), torch.mul(g32[f:, :r_u], s_gu[1]).to(b_u.dtype)]
        else:  # one adapter over [gate | up]: its A's gradient is the two halves' sum, its B's is G
            a, b = factors[:2]
            r = a.shape[0]
            grads += [
                (da_gu[:r] + da_gu[RANK : RANK + r]).to(a.dtype),
                torch.mul(g32[:, :r], s_gu[0]).to(b.dtype),
            ]
        return (dx, None, None, None, None, None, None, *grads, da_d[:r_d].to(a_d.dtype), db_d)


def lora_gated_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor | FrozenWeight,
    down_weight: torch.Tensor | FrozenWeight,
    gate_up: list[Adapter],
    down: list[Adapter],
    activation: Activation,
    operands: tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None],
    source: NormSource | None = None,
) -> torch.Tensor:
    """y (..., Kd) for x (..., K); `operands`: (A_gu, D_gu) and (A_d, D_d) in x's dtype from an
    AdapterCasts, or None to cast here; `source`: x is that norm's output, not kept (see
    gpu_kernels/ops/norm_source.py). Only for `fusable` arguments."""
    packed = len(gate_up) == 1
    gu_ops = _operands(gate_up, x.dtype, operands[0], packed)
    d_ops = _operands(down, x.dtype, operands[1], False)
    factors = [t for a, b, _ in (*gate_up, *down) for t in (a, b)]
    scales = (tuple(float(s) for _, _, s in gate_up), float(down[0][2]))
    out = LoRAGatedMLPFunction.apply(
        x, gate_up_weight, down_weight, ACTIVATIONS[activation], scales, (*gu_ops, *d_ops), source, *factors
    )
    assert isinstance(out, torch.Tensor)
    return out
