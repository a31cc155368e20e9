"""The LoRA linear op (gpu_kernels.ops.lora, csrc/lora.cu) and its reference
(gpu_kernels.ops.lora_reference): one projection, several sharing their input, and dropout.

The reference's own fp64 checks run everywhere; the compiled op against the reference, forward
and backward, in fp32 and bf16, for each of the three orders of adding the LoRA term, needs a
CUDA device (`gpu`). The CPU run of the op's plain-GEMM orders is test_lora_op_orders.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import gpu_kernels
from gpu_kernels.ops import lora as lora_ops
from gpu_kernels.ops import lora_reference as ref
from tests.gpu_kernels.oracle import DTYPES, Recorder, assert_matches_reference, randn, rel, shapes

# ------------------------------------------------------------------ the reference, fp64, on CPU


def test_reference_equals_the_naive_formula() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, generator=g, dtype=torch.float64)
    w, bias = (
        torch.randn(5, 9, generator=g, dtype=torch.float64),
        torch.randn(5, generator=g, dtype=torch.float64),
    )
    a, b = (
        torch.randn(4, 9, generator=g, dtype=torch.float64),
        torch.randn(5, 4, generator=g, dtype=torch.float64),
    )
    expect = x @ w.t() + bias + 0.5 * ((x @ a.t()) @ b.t())
    torch.testing.assert_close(ref.lora_linear(x, w, bias, a, b, 0.5), expect, rtol=1e-12, atol=1e-12)


def test_reference_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, bias, a, b = (
        torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
        for s in ((3, 7), (5, 7), (5,), (2, 7), (5, 2))
    )
    assert torch.autograd.gradcheck(
        lambda x, w, bias, a, b: ref.lora_linear(x, w, bias, a, b, 1.5), (x, w, bias, a, b)
    )
    adapters = lambda a, b: [(a[:1], b[:2, :1], 2.0), (a[1:], b[2:, 1:], 0.5)]  # noqa: E731
    assert torch.autograd.gradcheck(
        lambda x, a, b: ref.lora_linear_grouped(x, w, None, adapters(a, b)), (x, a, b)
    )


def test_grouped_lora_equals_separate_projections() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, generator=g, dtype=torch.float64)
    widths, ranks, scales = [8, 3, 3], [4, 2, 5], [2.0, 0.5, 1.0]
    w = torch.randn(sum(widths), 12, generator=g, dtype=torch.float64)
    adapters = [
        (
            torch.randn(r, 12, generator=g, dtype=torch.float64),
            torch.randn(n, r, generator=g, dtype=torch.float64),
            s,
        )
        for n, r, s in zip(widths, ranks, scales, strict=True)
    ]
    got = ref.lora_linear_grouped(x, w, None, adapters)
    parts = []
    for (a, b, s), wj in zip(adapters, w.split(widths), strict=True):
        parts.append(ref.lora_linear(x, wj, None, a, b, s))
    assert got.shape == (2, 5, 14)
    torch.testing.assert_close(got, torch.cat(parts, -1), rtol=1e-12, atol=1e-12)


def test_grouped_lora_rejects_adapters_that_do_not_cover_the_weight() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="cover 2 output features but weight has 5"):
        ref.lora_linear_grouped(x, torch.randn(5, 4), None, [(torch.randn(1, 4), torch.randn(2, 1), 1.0)])


def test_dropout_mask_matches_the_cuda_hash() -> None:
    # values of csrc/lora.cu's hash32 chain for seed 7, salt 3, indices 0..5 (computed with the
    # same C code compiled by gcc): the reference must reproduce the GPU mask bit for bit
    key_hashes = [180273132, 1041190268, 3099286096, 1083214138, 1497210757, 4034528124]
    keep = ref.dropout_mask(6, 0.3, seed=7, salt=3)
    assert keep.tolist() == [(h >> 8) >= int(0.3 * 2**24) for h in key_hashes]


def test_hash_dropout_keeps_about_1_minus_p_and_rescales() -> None:
    x = torch.ones(100_000)
    y = ref.hash_dropout(x, 0.25, seed=1, salt=2)
    kept = (y != 0).float().mean().item()
    assert kept == pytest.approx(0.75, abs=0.01)
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    assert torch.equal(y, ref.hash_dropout(x, 0.25, seed=1, salt=2))
    assert not torch.equal(y, ref.hash_dropout(x, 0.25, seed=2, salt=2))


# ------------------------------------------------------------ the compiled op, on a CUDA device


@pytest.fixture(params=["kernel", "cublas", "epilogue"])
def rank_update(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each order of adding the LoRA term: our rank-update kernel, a cuBLAS rank update, or the
    base GEMM's epilogue (the default)."""
    monkeypatch.setattr(lora_ops, "_RANK_UPDATE", request.param)
    yield request.param


# (M tokens, K in, N out, r): one token and odd widths first, then a rank over one launch's 16
SHAPES = shapes(
    [(1, 7, 5, 1), (37, 129, 67, 3), (4, 33, 1000, 16)],
    [(1000, 2048, 512, 16), (2048, 576, 1536, 16), (517, 1031, 263, 64), (64, 256, 130, 200)],
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k", "n", "r"), SHAPES)
def test_lora_linear_matches_reference(
    rank_update: str, dtype: torch.dtype, m: int, k: int, n: int, r: int, record_property: Recorder
) -> None:
    x = randn(m, k, dtype=dtype, grad=True)
    w = randn(n, k, dtype=dtype, scale=k**-0.5)
    a = randn(r, k, dtype=torch.float32, grad=True, scale=k**-0.5)
    b = randn(n, r, dtype=torch.float32, grad=True, scale=0.5)
    assert_matches_reference(
        lambda x, a, b: lora_ops.lora_linear(x, w, None, a, b, 2.0),
        lambda x, a, b: ref.lora_linear(x, w.to(x.dtype), None, a.to(x.dtype), b.to(x.dtype), 2.0),
        [x, a, b], torch.randn(m, n, device="cuda"), ["y", "dx", "dA", "dB"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_3d_input_with_bias(
    rank_update: str, dtype: torch.dtype, record_property: Recorder
) -> None:
    x = randn(2, 9, 40, dtype=dtype, grad=True)
    w = randn(24, 40, dtype=dtype, scale=0.2)
    bias = randn(24, dtype=dtype)
    a = randn(8, 40, dtype=torch.float32, grad=True, scale=0.2)
    b = randn(24, 8, dtype=torch.float32, grad=True)

    def reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        w_, bias_, a_, b_ = (t.to(x.dtype) for t in (w, bias, a, b))
        return ref.lora_linear(x, w_, bias_, a_, b_, 0.5)

    assert_matches_reference(
        lambda x, a, b: lora_ops.lora_linear(x, w, bias, a, b, 0.5), reference,
        [x, a, b], torch.randn(2, 9, 24, device="cuda"), ["y", "dx", "dA", "dB"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "k"), shapes([(1, 40), (17, 40)], [(300, 257)]))
def test_grouped_lora_matches_reference(
    rank_update: str, dtype: torch.dtype, m: int, k: int, record_property: Recorder
) -> None:
    """q/k/v-like: odd widths 96/33/33, ranks 8/4/16, different scales."""
    widths, ranks, scales = [96, 33, 33], [8, 4, 16], [2.0, 1.0, 0.25]
    x = randn(m, k, dtype=dtype, grad=True)
    w = randn(sum(widths), k, dtype=dtype, scale=k**-0.5)
    ads = []
    for n, r in zip(widths, ranks, strict=True):
        ads += [
            randn(r, k, dtype=torch.float32, grad=True, scale=k**-0.5),
            randn(n, r, dtype=torch.float32, grad=True),
        ]

    def ours(x: torch.Tensor, *ab: torch.Tensor) -> torch.Tensor:
        adapters = [(ab[2 * i], ab[2 * i + 1], scales[i]) for i in range(3)]
        return lora_ops.lora_linear_grouped(x, w, None, adapters)

    def reference(x: torch.Tensor, *ab: torch.Tensor) -> torch.Tensor:
        adapters = [(ab[2 * i].to(x.dtype), ab[2 * i + 1].to(x.dtype), scales[i]) for i in range(3)]
        return ref.lora_linear_grouped(x, w.to(x.dtype), None, adapters)

    names = ["y", "dx", "dA1", "dB1", "dA2", "dB2", "dA3", "dB3"]
    gy = torch.randn(m, sum(widths), device="cuda")
    assert_matches_reference(ours, reference, [x, *ads], gy, names, dtype, record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [1, 70 * 130, 4097])
def test_compiled_dropout_mask_is_the_reference_mask(dtype: torch.dtype, numel: int) -> None:
    p = 0.25
    x = randn(numel, dtype=dtype)
    seed = lora_ops.dropout_seed(x.device).clone().fill_(1234)
    out = lora_ops.dropout(x.contiguous(), p, seed, 99)
    assert torch.equal(out, ref.hash_dropout(x, p, 1234, 99))
    if numel > 1000:
        assert (out != 0).float().mean().item() == pytest.approx(1 - p, abs=0.03)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_linear_with_dropout_matches_the_masked_reference(
    rank_update: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, record_property: Recorder
) -> None:
    """Forward and backward against the reference fed the same masked input (the op draws salt
    777, the reference reproduces its mask)."""
    p = 0.25
    x = randn(70, 130, dtype=dtype, grad=True)
    monkeypatch.setattr(lora_ops, "_seeds", {})
    lora_ops.dropout_seed(x.device).fill_(1234)
    w = randn(50, 130, dtype=dtype, scale=0.1)
    a = randn(8, 130, dtype=torch.float32, grad=True, scale=0.1)
    b = randn(50, 8, dtype=torch.float32, grad=True)

    def ours(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        monkeypatch.setattr(lora_ops, "_salts", itertools.count(777))
        return lora_ops.lora_linear(x, w, None, a, b, 2.0, p, True)

    def reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        xd = ref.hash_dropout(x, p, 1234, 777)
        return F.linear(x, w.to(x.dtype)) + 2.0 * F.linear(F.linear(xd, a.to(x.dtype)), b.to(x.dtype))

    gy = torch.randn(70, 50, device="cuda")
    assert_matches_reference(ours, reference, [x, a, b], gy, ["y", "dx", "dA", "dB"], dtype, record_property)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "k", "n", "r"), [(37, 129, 67, 3), (256, 512, 256, 16)])
def test_dispatch_runs_the_compiled_op_on_cuda_fp32(m: int, k: int, n: int, r: int) -> None:
    x = torch.randn(m, k, device="cuda", requires_grad=True)
    w = torch.randn(n, k, device="cuda") / k**0.5
    a = (torch.randn(r, k, device="cuda") / k**0.5).requires_grad_()
    b = torch.randn(n, r, device="cuda").requires_grad_()
    y = gpu_kernels.lora_linear(x, w, None, a, b, 2.0)
    gy = torch.randn_like(y)
    y.backward(gy)
    x2, a2, b2 = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y2 = ref.lora_linear(x2, w, None, a2, b2, 2.0)
    y2.backward(gy)
    assert rel(y, y2) < 1e-5
    for g, g2 in ((x.grad, x2.grad), (a.grad, a2.grad), (b.grad, b2.grad)):
        assert g is not None and g2 is not None and rel(g, g2) < 1e-5
