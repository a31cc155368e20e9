"""Chooses the compiled or the reference implementation of each op, per call, by the rule of
gpu_kernels.backend (all tensors on CUDA, the kernels built, the backend not forced to
"reference")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from gpu_kernels import _lib, reference
from gpu_kernels.backend import compiled as _compiled
from gpu_kernels.backend import get_backend
from gpu_kernels.ops import lora_multi
from gpu_kernels.ops.adapter_casts import AdapterCasts
from gpu_kernels.ops.norm_act_reference import Activation
from gpu_kernels.ops.norm_source import NormSource
from gpu_kernels.ops.residual_norm_reference import DeltaNorm
from gpu_kernels.ops.rope_reference import HeadNorm
from gpu_kernels.quant.frozen import FrozenWeight


@dataclass(frozen=True)
class KernelStatus:
    compiled: bool
    reason: str


def available() -> KernelStatus:
    """Whether the compiled path is in use, and why (not)."""
    if not torch.cuda.is_available():
        return KernelStatus(False, "no CUDA device: using the plain-torch reference path")
    if get_backend() == "reference":
        return KernelStatus(False, "reference backend forced (LORAQ_KERNELS=reference or set_backend)")
    try:
        lib = _lib.load()
    except RuntimeError as exc:
        return KernelStatus(False, f"kernel build failed: {exc}")
    return KernelStatus(True, f"compiled kernels loaded from {lib._name}")


def require_compiled() -> None:
    """Raise when a GPU is present but the compiled path is not usable (build failed)."""
    status = available()
    if torch.cuda.is_available() and not status.compiled and get_backend() != "reference":
        raise RuntimeError(f"GPU present but compiled kernels unavailable: {status.reason}")


def _kernel_dtype(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors)


def _stored(weight: torch.Tensor | FrozenWeight) -> list[torch.Tensor]:
    """The tensors a frozen base weight is stored in, for the device check: a dense weight itself,
    or a compact one's packed tensors (NF4, int8, GGML blocks), over whose dequantized tiles the
    compiled LoRA ops run their base GEMMs (gpu_kernels.quant.frozen.linear_into). A non-float
    dense tensor is an error: it would otherwise fall to F.linear and compute nonsense."""
    if isinstance(weight, FrozenWeight):
        return list(weight.tensors().values())
    if not weight.is_floating_point():
        raise TypeError(f"a LoRA base weight of dtype {weight.dtype} must be wrapped as a FrozenWeight")
    return [weight]


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
    """y = x·Wᵀ + b + s·(drop(x)·Aᵀ)·Bᵀ, shape (..., out). A FrozenWeight base runs its GEMMs
    over dequantized tiles (gpu_kernels.quant), in the compiled op as in the reference."""
    if _compiled(x, bias, lora_a, lora_b, *_stored(weight)) and _kernel_dtype(x) and x.dtype == weight.dtype:
        from gpu_kernels.ops import lora

        return lora.lora_linear(x, weight, bias, lora_a, lora_b, scale, dropout_p, training)
    return reference.lora_linear(x, weight, bias, lora_a, lora_b, scale, dropout_p, training)


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
    """Several LoRA projections of one input, stacked: (..., Σ out_j). See reference.
    `operands`: the adapters in x's dtype from an AdapterCasts (`adapter_casts`), used by the
    compiled path when given (the reference reads the factors). `source`: x is that RMSNorm's
    output (`add_rms_norm`'s third value); the compiled path then does not keep x."""
    tensors = [t for a, b, _ in adapters for t in (a, b)]
    if _compiled(x, bias, *tensors, *_stored(weight)) and _kernel_dtype(x) and x.dtype == weight.dtype:
        from gpu_kernels.ops import lora

        return lora.lora_linear_grouped(x, weight, bias, adapters, dropout_p, training, operands, source)
    return reference.lora_linear_grouped(x, weight, bias, adapters, dropout_p, training)


def adapter_casts(
    ops: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor, float]]], dtype: torch.dtype
) -> AdapterCasts:
    """The `dtype` operands of these LoRA ops (each a list of (A, B, scale)), refreshed in one
    launch on the compiled path (torch ops otherwise): see gpu_kernels.ops.adapter_casts."""
    factors = [t for adapters in ops for a, b, _ in adapters for t in (a, b)]
    compiled = bool(factors) and _compiled(*factors) and dtype in (torch.float32, torch.bfloat16)
    return AdapterCasts(ops, dtype, compiled=compiled)


def lora_linear_multi(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scales: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """Serving: row b of x (B, S, in) gets adapter index[b] of the stacks; (B, S, out). On CUDA the
    compiled multi-adapter kernel (gpu_kernels.ops.lora_multi; gradient for x only, so the reference
    runs when a gradient of the weights or factors is being recorded; a served model's weights
    require grad but serving runs under inference_mode), elsewhere the gathered reference. Neither
    syncs with the host. See reference.lora_linear_multi."""
    if (
        _compiled(x, weight, bias, lora_a, lora_b, scales, index)
        and _kernel_dtype(x)
        and x.dtype == weight.dtype
        and x.dim() == 3
        and lora_a.dtype == lora_b.dtype == scales.dtype == torch.float32
        and 1 <= lora_a.shape[1] <= lora_multi.MAX_RANK
        and not (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (weight, bias, lora_a, lora_b))
        )
    ):
        return lora_multi.lora_linear_multi(x, weight, bias, lora_a, lora_b, scales, index)
    return reference.lora_linear_multi(x, weight, bias, lora_a, lora_b, scales, index)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """(offset + w) ⊙ x / sqrt(mean(x²) + eps) over the last dim; offset 1 for Gemma's weights."""
    if _compiled(x, weight) and _kernel_dtype(x):
        from gpu_kernels.ops import norm_act

        return norm_act.rms_norm(x, weight, eps, offset)
    return reference.rms_norm(x, weight, eps, offset)


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
    """act(gate) ⊙ up: SwiGLU, or GeGLU with activation "gelu_tanh"."""
    if _compiled(gate, up) and _kernel_dtype(gate) and gate.dtype == up.dtype and gate.shape == up.shape:
        from gpu_kernels.ops import norm_act

        return norm_act.swiglu(gate, up, activation)
    return reference.swiglu(gate, up, activation)


def add_rms_norm(
    residual: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    offset: float = 0.0,
    delta_norm: DeltaNorm | None = None,
    keep_sum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, NormSource | None]:
    """(h, norm(h), source) with h = residual + delta, or residual + norm_p(delta) given
    delta_norm (weight, eps): a decoder layer's residual step and the norm after it, one kernel
    each way on the compiled path (frozen weights). See reference.add_rms_norm. keep_sum=False
    (with delta_norm; compiled path): the backward forms h again from residual and delta instead
    of keeping it (ops.residual_norm), the same values for one (..., D) tensor less where the
    caller keeps residual anyway. `source` (compiled path, h kept): what the LoRA ops that read
    norm(h) may keep instead of it (gpu_kernels/ops/norm_source.py); None otherwise."""
    weights = (weight, delta_norm[0]) if delta_norm is not None else (weight,)
    if (
        _compiled(residual, delta, *weights)
        and _kernel_dtype(residual)
        and residual.dtype == delta.dtype
        and residual.shape == delta.shape
        and not any(w.requires_grad for w in weights)
    ):
        from gpu_kernels.ops import residual_norm

        return residual_norm.add_rms_norm(residual, delta, weight, eps, offset, delta_norm, keep_sum)
    return (*reference.add_rms_norm(residual, delta, weight, eps, offset, delta_norm), None)


@dataclass(frozen=True)
class LoRAOp:
    """One LoRA op's arguments, as lora_linear_grouped takes them: the frozen base, its adapters
    (A_j, B_j, s_j), the LoRA input's dropout and, inside a step, the activation-dtype operands
    (A_cat, D) from an AdapterCasts (None: cast in the call)."""

    weight: torch.Tensor | FrozenWeight
    bias: torch.Tensor | None
    adapters: Sequence[tuple[torch.Tensor, torch.Tensor, float]]
    dropout_p: float = 0.0
    operands: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, training: bool, source: NormSource | None = None) -> torch.Tensor:
        """`source`: x is that RMSNorm's output (see lora_linear_grouped)."""
        return lora_linear_grouped(
            x, self.weight, self.bias, self.adapters, self.dropout_p, training, self.operands, source
        )


def lora_gated_mlp(
    x: torch.Tensor,
    gate_up: LoRAOp,
    down: LoRAOp,
    activation: Activation,
    training: bool,
    source: NormSource | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) ⊙ up(x)) with LoRA on the three projections; `gate_up` stacks gate's
    and up's outputs ([gate | up], 2F): two adapters, or one over both (Phi-3's gate_up_proj).
    Where gpu_kernels.ops.lora_mlp serves it (CUDA, bf16 weights, dense or compact, adapters of
    rank ≤ 16, no dropout, no biases) one op whose backward folds the LoRA reductions into the activation's;
    otherwise the two LoRA ops and swiglu_packed. `source`: x is that RMSNorm's output, which
    the compiled ops then do not keep (gpu_kernels/ops/norm_source.py)."""
    from gpu_kernels.ops import lora_mlp

    gu_w, down_w = gate_up.weight, down.weight
    p_gu, p_down = (gate_up.dropout_p, down.dropout_p) if training else (0.0, 0.0)
    factors = [t for op in (gate_up, down) for a, b, _ in op.adapters for t in (a, b)]
    if (
        gate_up.bias is None
        and down.bias is None
        and p_gu == 0.0
        and p_down == 0.0
        and _compiled(x, *factors, *_stored(gu_w), *_stored(down_w))
        and lora_mlp.fusable(x, gu_w, down_w, list(gate_up.adapters), list(down.adapters))
    ):
        return lora_mlp.lora_gated_mlp(
            x, gu_w, down_w, list(gate_up.adapters), list(down.adapters), activation,
            (gate_up.operands, down.operands), source,
        )  # fmt: skip
    return down(swiglu_packed(gate_up(x, training, source), activation), training)


def swiglu_packed(gate_up: torch.Tensor, activation: Activation = "silu") -> torch.Tensor:
    """swiglu of [gate | up] packed on the last dim: (..., 2F) -> (..., F)."""
    if _compiled(gate_up) and _kernel_dtype(gate_up):
        from gpu_kernels.ops import norm_act

        return norm_act.swiglu_packed(gate_up, activation)
    return reference.swiglu_packed(gate_up, activation)


def rope_qkv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    positions: torch.Tensor | None = None,
    norm: HeadNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the packed (B, S, (H+2G)·D) q/k/v rows, normalise q and k per head when `norm` is
    given, and rotate the first R dims of q and k: q (B, H, S, D), k and v (B, G, S, D). cos/sin
    are (1 or B, S, R), or (1, P, R) read at positions (B, S) when those are given; R <= D.
    See reference.rope_qkv."""
    if _rope_kernel_serves(qkv, cos, sin, n_heads, n_kv_heads, positions, norm):
        from gpu_kernels.ops import rope

        return rope.rope_qkv(qkv, cos, sin, n_heads, n_kv_heads, positions, norm)
    return reference.rope_qkv(qkv, cos, sin, n_heads, n_kv_heads, positions, norm)


def _rope_kernel_serves(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    positions: torch.Tensor | None,
    norm: HeadNorm | None,
) -> bool:
    """Whether the compiled rope kernel takes this call: every tensor on the compiled path, a
    kernel dtype, (B, S, width) rows, and a head its per-head norm covers."""
    weights = (norm.q_weight, norm.k_weight) if norm is not None else ()
    if not (_compiled(qkv, cos, sin, positions, *weights) and _kernel_dtype(qkv) and qkv.dim() == 3):
        return False
    from gpu_kernels.ops import rope

    d = reference.rope_head_size(qkv.shape[-1], n_heads, n_kv_heads)
    return norm is None or rope.norm_fits(d, int(cos.shape[-1]))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean CE of hidden·Wᵀ against targets (or its sum times `scale`), without materialising
    all logits on the GPU. A trainable weight takes the reference path (the compiled one forms
    no weight gradient)."""
    if _compiled(hidden, weight, targets, scale) and _kernel_dtype(hidden) and not weight.requires_grad:
        from gpu_kernels.ops import cross_entropy

        return cross_entropy.fused_linear_cross_entropy(hidden, weight, targets, ignore_index, scale=scale)
    return reference.fused_linear_cross_entropy(hidden, weight, targets, ignore_index, scale)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention confined to each sequence of a packed (N, heads, D) batch, the
    sequences given by cu_seqlens (K + 1,) int32; GQA when k/v have fewer heads; with `window`
    W, a token sees itself and the W − 1 tokens before it. No mask and, on the GPU, no host sync
    (a fixed-size cu_seqlens keeps the call capturable). See reference.varlen_attention."""
    if _compiled(q, k, v, cu_seqlens) and q.dtype in (torch.float16, torch.bfloat16):
        from gpu_kernels.ops import varlen

        return varlen.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, window)
    return reference.varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale, window)


def rope_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    positions: torch.Tensor | None = None,
    norm: HeadNorm | None = None,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """`rope_qkv` then `varlen_attention` over the B·S tokens of qkv (B, S, (H + 2G)·D) packed at
    cu_seqlens: the attention output (B·S, H, D). With a q/k `norm` on the compiled path, one op
    that keeps only the projected rows for the backward and rotates them again there (see
    gpu_kernels.ops.rope_attention: the same values, (H + 2G)·D fewer saved elements a token);
    without a norm the two ops save no more than that already."""
    if (
        norm is not None
        and qkv.dtype == torch.bfloat16  # flash attention's dtype and the rope kernel's
        and _compiled(cu_seqlens)
        and _rope_kernel_serves(qkv, cos, sin, n_heads, n_kv_heads, positions, norm)
    ):
        from gpu_kernels.ops import rope_attention

        return rope_attention.rope_varlen_attention(
            qkv, cos, sin, n_heads, n_kv_heads, positions, norm.q_weight, norm.k_weight,
            norm.eps, norm.offset, cu_seqlens, max_seqlen, scale, window,
        )  # fmt: skip
    q, k, v = rope_qkv(qkv, cos, sin, n_heads, n_kv_heads, positions, norm)
    qp, kp, vp = (reference.packed_rows(t) for t in (q, k, v))
    return varlen_attention(qp, kp, vp, cu_seqlens, max_seqlen, scale, window)


def new_nonfinite_state(device: torch.device | str) -> torch.Tensor:
    return reference.new_nonfinite_state(device)


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, nonfinite_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Clip grads in place to global L2 norm max_norm; returns the norm as a 0-d fp32 device
    tensor (no host sync on the compiled path). See reference.clip_grad_norm_."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if (
        grads
        and _compiled(*grads, nonfinite_state)
        and all(g.dtype == torch.float32 and g.is_contiguous() for g in grads)
        and len({g.device for g in grads}) == 1
    ):
        from gpu_kernels.ops import clip

        return clip.clip_grad_norm_(grads, max_norm, nonfinite_state)
    return reference.clip_grad_norm_(params, max_norm, nonfinite_state)


def dropout_seed_step_(device: torch.device) -> None:
    """Advance the device's LoRA-dropout seed (call once per training step; capturable)."""
    if _compiled(torch.empty(0, device=device)):
        from gpu_kernels.ops import lora

        lora.next_dropout_seed_(device)
