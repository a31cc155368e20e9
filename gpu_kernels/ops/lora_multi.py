"""Mixed-adapter LoRA for serving on the GPU (BGMV, the idea of Punica's SGMV and S-LoRA): row b
of a batch x (B, S, in) gets the adapter slot index[b] of the stacks, with no host sync, so a
decode step that runs it can be captured in a CUDA graph.

    y = x·Wᵀ + bias                                    cuBLAS (torch), (B, S, out)
    y[b] += scales[i]·(x[b]·A[i]ᵀ)·B[i]ᵀ,  i = index[b]   in place on y

The LoRA term takes one of two sync-free forms, by the number of tokens T = B·S:
- T <= KERNEL_MAX_TOKENS (decode: one token per row): csrc/lora_multi.cu, a shrink launch
  (x·A[i]ᵀ in fp32, (T, r)) and an expand launch (added into y, rounded once); nothing is gathered
  and slots of scale 0 cost nothing;
- longer inputs (prefill): gathered batched GEMMs, A[index] (B, r, in) and s·B[index]ᵀ (B, r, out)
  rounded to x's dtype as under PEFT's autocast, then y.baddbmm_: one copy of the factors per
  row, reused by its S tokens (the kernel re-reads A and B from L2 for every token).
Measured on an H100 (bench/serve_bench.py's `lora_op_us`: eager calls in a loop, host overhead
included; llama-1b shapes, r = 16, bf16): the kernel is ahead up to 512 tokens (32x1, 1x256,
8x64), the gathered GEMMs at 8,192 (32x256), where the kernel's per-token re-reads of A and B
cost 350-1,100 us against about 230 us. Between 512 and 8,192 tokens nothing was measured.
The backward (dx only: serving never trains) is the gathered form in torch.
gpu_kernels.ops.lora_multi_reference is the oracle and the CPU path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from gpu_kernels import _lib

# Above this many tokens the gathered GEMMs run instead of the kernel (see the module docstring).
KERNEL_MAX_TOKENS = 512
MAX_RANK = 64  # csrc/lora_multi.cu's kMaxRank


def lora_linear_multi(
    x: torch.Tensor,  # (B, S, in), bf16 or fp32 CUDA
    weight: torch.Tensor,  # (out, in), x's dtype
    bias: torch.Tensor | None,  # (out,)
    lora_a: torch.Tensor,  # (N, r, in) fp32, r <= 64
    lora_b: torch.Tensor,  # (N, out, r) fp32
    scales: torch.Tensor,  # (N,) fp32
    index: torch.Tensor,  # (B,) int64
) -> torch.Tensor:
    """Same math and shapes as lora_multi_reference.lora_linear_multi; gradient for x only."""
    out = _LoraMulti.apply(x, weight, bias, lora_a, lora_b, scales, index)
    assert isinstance(out, torch.Tensor)
    return out


def kernel_add_(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
    index: torch.Tensor,
) -> None:  # fmt: skip
    """y (B, S, out) += each row's LoRA term, by csrc/lora_multi.cu (any number of tokens)."""
    b, s, k = x.shape
    n_slots, r, _ = lora_a.shape
    x2 = x.contiguous()
    a, bb, sc = lora_a.contiguous(), lora_b.contiguous(), scales.contiguous()
    idx = index.to(torch.int64).contiguous()
    lib = _lib.load()
    partials = torch.empty(
        int(lib.loraq_lora_multi_workspace(b * s, k, r)), dtype=torch.float32, device=x.device
    )
    rc = lib.loraq_lora_multi(
        y.data_ptr(), x2.data_ptr(), _lib.dtype_code(x.dtype), b * s, s, k, y.shape[-1],
        a.data_ptr(), bb.data_ptr(), sc.data_ptr(), idx.data_ptr(), n_slots, r, partials.data_ptr(),
        _lib.stream(x.device),
    )  # fmt: skip
    _lib.check(rc, "loraq_lora_multi")


def gathered_add_(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scales: torch.Tensor,
    index: torch.Tensor,
) -> None:  # fmt: skip
    """y (B, S, out) += each row's LoRA term, by two batched GEMMs on gathered factors."""
    a = lora_a[index].to(x.dtype)  # (B, r, in)
    bt = (lora_b[index] * scales[index][:, None, None]).to(x.dtype).transpose(1, 2)  # (B, r, out)
    y.baddbmm_(torch.bmm(x, a.transpose(1, 2)), bt)  # (B, S, r)·(B, r, out)


class _LoraMulti(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scales: torch.Tensor,
        index: torch.Tensor,
    ) -> torch.Tensor:
        y = F.linear(x, weight, bias).contiguous()  # (B, S, out)
        if x.shape[0] * x.shape[1] <= KERNEL_MAX_TOKENS:
            kernel_add_(y, x, lora_a, lora_b, scales, index)
        else:
            gathered_add_(y, x, lora_a, lora_b, scales, index)
        ctx.save_for_backward(weight, lora_a, lora_b, scales, index)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        weight, lora_a, lora_b, scales, index = ctx.saved_tensors
        a = lora_a[index].to(gy.dtype)  # (B, r, in)
        b = (lora_b[index] * scales[index][:, None, None]).to(gy.dtype)  # (B, out, r)
        dx = gy @ weight  # (B, S, in)
        dx.baddbmm_(torch.bmm(gy, b), a)  # (B, S, r)·(B, r, in)
        return dx, None, None, None, None, None, None
