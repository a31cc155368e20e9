"""A decoder layer's residual add fused with the RMSNorm after it (gpu_kernels.ops.residual_norm,
csrc/residual_norm.cu) and its reference (gpu_kernels.ops.residual_norm_reference).

On the CPU, in fp64: the reference against transformers' own layer steps (Llama's pre-norm add,
Gemma 3's sandwich: the norm on the sublayer's output, the add, the next norm) and gradcheck. On a
CUDA device (`gpu`): the compiled op against the reference, forward and backward (both gradients,
with and without a gradient arriving on the sum), in fp32 and bf16, pre-norm and sandwich, rows
that take the vector path and rows that do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from gpu_kernels.ops import residual_norm
from gpu_kernels.ops import residual_norm_reference as ref
from tests.gpu_kernels.oracle import DTYPES, Recorder, assert_matches_reference, randn, saved_storages, shapes

# ------------------------------------------------------------------ the reference, fp64, on CPU


def test_pre_norm_step_matches_llama() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(24, eps=1e-5).double()
    torch.nn.init.normal_(norm.weight, mean=1.0, std=0.3)
    r, y = torch.randn(5, 24, dtype=torch.float64), torch.randn(5, 24, dtype=torch.float64)
    h, n = ref.add_rms_norm(r, y, norm.weight, 1e-5)
    assert torch.equal(h, r + y)
    torch.testing.assert_close(n, norm(r + y), rtol=1e-6, atol=1e-6)  # transformers' norm: float32


def test_sandwich_step_matches_gemma3() -> None:
    """Gemma 3: h = r + post_norm(y), then pre_feedforward_norm(h), both with (1 + w)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    post, pre = Gemma3RMSNorm(24, eps=1e-6), Gemma3RMSNorm(24, eps=1e-6)
    for m in (post, pre):
        torch.nn.init.normal_(m.weight, std=0.3)
    r, y = torch.randn(5, 24) * 3, torch.randn(5, 24) * 3
    h, n = ref.add_rms_norm(r, y, pre.weight, 1e-6, 1.0, (post.weight, 1e-6))
    torch.testing.assert_close(h, r + post(y), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(n, pre(r + post(y)), rtol=1e-6, atol=1e-6)


def test_reference_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    r, y = (torch.randn(3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, wp = (torch.randn(8, generator=g, dtype=torch.float64) for _ in range(2))

    def both(r: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, n = ref.add_rms_norm(r, y, w, 1e-6, 1.0, (wp, 1e-5))
        return torch.cat([h, 2 * n])

    assert torch.autograd.gradcheck(both, (r, y))


# ------------------------------------------------------------ the compiled op, on a CUDA device

# (rows, D): Gemma-3-1B's 1152 and Llama-8B's 4096 on the vector path; 37 on the scalar one
SHAPES = shapes([(3, 37), (5, 1152)], [(4096, 4096), (8192, 1152)])


@pytest.mark.gpu
@pytest.mark.parametrize("sum_used", [True, False], ids=["sum_used", "norm_only"])
@pytest.mark.parametrize("sandwich", [False, True], ids=["pre_norm", "sandwich"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d"), SHAPES)
def test_add_rms_norm_matches_reference(
    m: int, d: int, dtype: torch.dtype, sandwich: bool, sum_used: bool, record_property: Recorder
) -> None:
    """Both outputs weighted into one (a layer's sum goes on down the stream, its norm into the
    next sublayer); norm_only: no gradient arrives on the sum (the last layer before the final
    norm)."""
    offset = 1.0 if sandwich else 0.0
    w = (0.3 * torch.randn(d, device="cuda") + (1 - offset)).to(dtype)
    wp = (0.3 * torch.randn(d, device="cuda")).to(dtype) if sandwich else None
    r, y = randn(m, d, dtype=dtype, grad=True, scale=2.0), randn(m, d, dtype=dtype, grad=True, scale=2.0)

    def run(op: Callable[..., Any], r: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        delta = (wp.to(r.dtype), 1e-5) if wp is not None else None
        h, n = op(r, y, w.to(r.dtype), 1e-6, offset, delta)[:2]  # ours adds n's NormSource
        return torch.cat([h if sum_used else h.detach() * 0, n], dim=1)

    assert_matches_reference(
        lambda r, y: run(residual_norm.add_rms_norm, r, y),
        lambda r, y: run(ref.add_rms_norm, r, y),
        [r, y], torch.randn(m, 2 * d, device="cuda"), ["sum_and_norm", "dresidual", "ddelta"], dtype,
        record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d"), SHAPES)
def test_a_sum_formed_again_is_the_kept_one_bit_for_bit(m: int, d: int, dtype: torch.dtype) -> None:
    """keep_sum=False (sandwich): the backward forms h from the residual and delta instead of
    keeping it; outputs and both gradients are those of keep_sum=True bit for bit, and the op
    keeps the residual's storage, not the sum's."""
    w = (0.3 * torch.randn(d, device="cuda")).to(dtype)
    wp = (0.3 * torch.randn(d, device="cuda")).to(dtype)
    r0, y0 = randn(m, d, dtype=dtype, scale=2.0), randn(m, d, dtype=dtype, scale=2.0)
    gh, gn = torch.randn(m, d, device="cuda", dtype=dtype), torch.randn(m, d, device="cuda", dtype=dtype)
    runs = {}
    for keep in (True, False):
        r, y = r0.detach().clone().requires_grad_(), y0.detach().clone().requires_grad_()
        with saved_storages() as kept:
            h, n, _ = residual_norm.add_rms_norm(r, y, w, 1e-6, 1.0, (wp, 1e-5), keep_sum=keep)
        ((h * gh).float().sum() + (n * gn).float().sum()).backward()
        assert r.grad is not None and y.grad is not None
        sum_kept = h.untyped_storage().data_ptr() in kept
        residual_kept = r.untyped_storage().data_ptr() in kept
        runs[keep] = (h.detach(), n.detach(), r.grad, y.grad, sum_kept, residual_kept)
    for a, b in zip(runs[True][:4], runs[False][:4], strict=True):
        assert torch.equal(a, b)
    assert runs[True][4:] == (True, False) and runs[False][4:] == (False, True)
