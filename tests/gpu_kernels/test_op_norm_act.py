"""RMSNorm and SwiGLU (gpu_kernels.ops.norm_act, csrc/norm_act.cu) and their reference
(gpu_kernels.ops.norm_act_reference).

The reference's own fp64 checks run everywhere; the compiled ops against the reference, forward
and backward, in fp32 and bf16, need a CUDA device (`gpu`).
"""

from __future__ import annotations

import pytest
import torch

import gpu_kernels
from gpu_kernels.ops import norm_act
from gpu_kernels.ops import norm_act_reference as ref
from gpu_kernels.ops.norm_act_reference import Activation
from tests.gpu_kernels.oracle import DTYPES, Recorder, assert_matches_reference, randn, rel, shapes

# ------------------------------------------------------------------ the reference, fp64, on CPU


def test_rms_norm_formula_and_dtype() -> None:
    x = torch.randn(3, 7, dtype=torch.float64)
    w = torch.randn(7, dtype=torch.float64)
    expect = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-5), expect)
    xb = x.to(torch.bfloat16)
    assert ref.rms_norm(xb, w.to(torch.bfloat16), 1e-5).dtype == torch.bfloat16


def test_swiglu_and_packed_agree() -> None:
    gu = torch.randn(4, 10, dtype=torch.float64)
    g, u = gu[:, :5], gu[:, 5:]
    torch.testing.assert_close(ref.swiglu_packed(gu), g * torch.sigmoid(g) * u)
    torch.testing.assert_close(ref.swiglu(g, u), ref.swiglu_packed(gu))


def test_reference_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: ref.rms_norm(x, w, 1e-5), (x, w))
    gu = torch.randn(3, 10, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ref.swiglu_packed, (gu,))


def test_rms_norm_offset_matches_gemma3() -> None:
    """Gemma's (1 + w) weights: offset 1, against transformers' Gemma3RMSNorm (which computes in
    float32, so float32 inputs keep the comparison exact to rounding)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    norm = Gemma3RMSNorm(24, eps=1e-6)
    torch.nn.init.normal_(norm.weight, std=0.3)
    x = torch.randn(5, 24) * 4
    torch.testing.assert_close(ref.rms_norm(x, norm.weight, 1e-6, offset=1.0), norm(x), rtol=1e-6, atol=1e-6)


def test_gelu_tanh_gate_matches_transformers() -> None:
    """GeGLU (Gemma's gelu_pytorch_tanh, Phi's gelu_new) against transformers' activations."""
    from transformers.activations import ACT2FN

    gu = torch.randn(4, 12, dtype=torch.float64) * 3
    g, u = gu[:, :6], gu[:, 6:]
    for name in ("gelu_pytorch_tanh", "gelu_new"):
        torch.testing.assert_close(
            ref.swiglu_packed(gu, "gelu_tanh"), ACT2FN[name](g) * u, rtol=1e-12, atol=1e-12
        )
    gu.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: ref.swiglu_packed(t, "gelu_tanh"), (gu,))
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: ref.rms_norm(x, w, 1e-5, 1.0), (x, w))


def test_reference_bf16_is_rounded_once_from_fp32() -> None:
    x = torch.randn(5, 33).bfloat16()
    w = torch.randn(33).bfloat16()
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    want = (w.float() * (x.float() * rstd)).bfloat16()
    assert torch.equal(ref.rms_norm(x, w, 1e-6), want)


# ------------------------------------------------------------ the compiled ops, on a CUDA device


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d"), shapes([(1, 7), (37, 576), (5, 4097)], [(2048, 2048), (300, 8192)]))
def test_rms_norm_matches_reference(dtype: torch.dtype, m: int, d: int, record_property: Recorder) -> None:
    x = randn(m, d, dtype=dtype, grad=True, scale=3.0)
    w = (1 + 0.1 * torch.randn(d, device="cuda")).to(dtype)
    assert_matches_reference(
        lambda x: norm_act.rms_norm(x, w, 1e-5), lambda x: ref.rms_norm(x, w.to(x.dtype), 1e-5),
        [x], torch.randn(m, d, device="cuda"), ["y", "dx"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_weight_gradient_matches_reference(dtype: torch.dtype, record_property: Recorder) -> None:
    """The rare trainable-weight path (plain torch from the saved rstd)."""
    x = randn(9, 65, dtype=dtype, grad=True)
    w = (1 + 0.1 * torch.randn(65, device="cuda")).to(dtype).requires_grad_()
    assert_matches_reference(
        lambda x, w: norm_act.rms_norm(x, w, 1e-5), lambda x, w: ref.rms_norm(x, w, 1e-5),
        [x, w], torch.randn(9, 65, device="cuda"), ["y", "dx", "dw"], dtype, record_property,
    )  # fmt: skip


SWIGLU_SHAPES = shapes([(1, 3), (33, 1536), (7, 1001)], [(4096, 8192)])


# SwiGLU, and GeGLU (Gemma's tanh-approximated GELU gate)
ACTIVATIONS = ["silu", "gelu_tanh"]


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "f"), SWIGLU_SHAPES)
def test_swiglu_matches_reference(
    dtype: torch.dtype, m: int, f: int, activation: Activation, record_property: Recorder
) -> None:
    g = randn(m, f, dtype=dtype, grad=True, scale=2.0)
    u = randn(m, f, dtype=dtype, grad=True)
    gy = torch.randn(m, f, device="cuda")
    assert_matches_reference(
        lambda a, b: norm_act.swiglu(a, b, activation), lambda a, b: ref.swiglu(a, b, activation),
        [g, u], gy, ["h", "dg", "du"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "f"), SWIGLU_SHAPES)
def test_swiglu_packed_matches_reference(
    dtype: torch.dtype, m: int, f: int, activation: Activation, record_property: Recorder
) -> None:
    gu = randn(m, 2 * f, dtype=dtype, grad=True, scale=2.0)
    gy = torch.randn(m, f, device="cuda")
    assert_matches_reference(
        lambda t: norm_act.swiglu_packed(t, activation), lambda t: ref.swiglu_packed(t, activation),
        [gu], gy, ["h", "dgu"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "d"), shapes([(1, 7), (37, 576), (5, 2560)], [(2048, 3840)]))
def test_rms_norm_with_offset_matches_reference(
    dtype: torch.dtype, m: int, d: int, record_property: Recorder
) -> None:
    """Gemma's norms: weights around 0, scaled by (1 + w)."""
    x = randn(m, d, dtype=dtype, grad=True, scale=3.0)
    w = (0.1 * torch.randn(d, device="cuda")).to(dtype)
    assert_matches_reference(
        lambda x: norm_act.rms_norm(x, w, 1e-6, 1.0), lambda x: ref.rms_norm(x, w.to(x.dtype), 1e-6, 1.0),
        [x], torch.randn(m, d, device="cuda"), ["y", "dx"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_on_strided_views_matches_reference(dtype: torch.dtype, record_property: Recorder) -> None:
    """Strided views of one (M, 2F) buffer, as the MLP's grouped gate/up produces them."""
    gu = randn(64, 200, dtype=dtype, grad=True)
    assert_matches_reference(
        lambda t: norm_act.swiglu(t[:, :100], t[:, 100:]), lambda t: ref.swiglu(t[:, :100], t[:, 100:]),
        [gu], torch.randn(64, 100, device="cuda"), ["h", "dgu"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
def test_dispatch_runs_the_compiled_ops_on_cuda_bf16() -> None:
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    assert rel(gpu_kernels.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) < 1e-2
    gu = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    assert rel(gpu_kernels.swiglu_packed(gu), ref.swiglu_packed(gu)) < 1e-2
