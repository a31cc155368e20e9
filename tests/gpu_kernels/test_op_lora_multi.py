"""The mixed-adapter LoRA op of serving (gpu_kernels.ops.lora_multi, SGMV) and its reference
(gpu_kernels.ops.lora_multi_reference, BGMV) against a loop of single-adapter LoRA layers.

Each row of a batch carries an adapter index; slots have different ranks (zero-padded in the
stacks) and slot 0 is "no adapter". Both implementations, the gathered reference (BGMV) and the
segmented one (SGMV, what CUDA runs), must equal applying each row's own adapter alone. On a
CUDA device (`gpu`), the segmented op is compared with the reference in fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

import gpu_kernels
from gpu_kernels.ops import lora_multi
from gpu_kernels.ops import lora_multi_reference as ref
from gpu_kernels.ops.lora_reference import lora_linear
from tests.gpu_kernels.oracle import DTYPES, Recorder, assert_matches_reference, randn, shapes

IN, OUT, R_MAX = 24, 40, 8
RANKS = [0, 2, 8, 5]  # slot 0: the base model alone


def _stacks(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple]]:
    n = len(RANKS)
    a = torch.zeros(n, R_MAX, IN, dtype=torch.float64)
    b = torch.zeros(n, OUT, R_MAX, dtype=torch.float64)
    scales = torch.zeros(n, dtype=torch.float64)
    singles = []  # (A (r, in), B (out, r), s) unpadded, per slot
    for i, r in enumerate(RANKS):
        ai = torch.randn(r, IN, generator=gen, dtype=torch.float64)
        bi = torch.randn(OUT, r, generator=gen, dtype=torch.float64)
        si = 0.0 if r == 0 else 16.0 / r
        a[i, :r], b[i, :, :r], scales[i] = ai, bi, si
        singles.append((ai, bi, si))
    return a, b, scales, singles


@pytest.mark.parametrize("impl", [ref.lora_linear_multi, lora_multi.lora_linear_multi])
def test_mixed_batch_equals_each_row_with_its_own_adapter(impl) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, IN, generator=gen, dtype=torch.float64)  # (B, S, in)
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    bias = torch.randn(OUT, generator=gen, dtype=torch.float64)
    a, b, scales, singles = _stacks(gen)
    index = torch.tensor([2, 0, 3, 2, 1, 3])

    y = impl(x, w, bias, a, b, scales, index)

    assert y.shape == (6, 5, OUT)
    for row, slot in enumerate(index.tolist()):
        ai, bi, si = singles[slot]
        if RANKS[slot] == 0:
            expected = torch.nn.functional.linear(x[row], w, bias)
        else:
            expected = lora_linear(x[row], w, bias, ai, bi, si)
        torch.testing.assert_close(y[row], expected, rtol=1e-12, atol=1e-12)


def test_adapter_rows_differ_from_base_rows() -> None:
    """A non-zero adapter changes its rows (the test above would pass for an op ignoring A, B if
    every slot were zero)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, IN, generator=gen, dtype=torch.float64).expand(2, 3, IN).contiguous()
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    a, b, scales, _ = _stacks(gen)
    y = gpu_kernels.lora_linear_multi(x, w, None, a, b, scales, torch.tensor([0, 2]))
    assert (y[0] - y[1]).abs().max() > 1e-3


def test_float32_stacks_with_a_16_bit_base() -> None:
    """Serving on a GPU keeps the base in bf16 and the adapters in fp32, as training does."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 2, IN, generator=gen).bfloat16()
    w = torch.randn(OUT, IN, generator=gen).bfloat16()
    a, b, scales, _ = _stacks(gen)
    a, b, scales = a.float(), b.float(), scales.float()
    index = torch.tensor([1, 3, 1])
    gathered = ref.lora_linear_multi(x, w, None, a, b, scales, index)
    seg = lora_multi.lora_linear_multi(x, w, None, a, b, scales, index)
    assert gathered.dtype == seg.dtype == torch.bfloat16
    torch.testing.assert_close(gathered.float(), seg.float(), rtol=2e-2, atol=2e-2)


def test_reference_gradients_pass_gradcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    a, b, scales, _ = _stacks(gen)
    x = torch.randn(3, 2, IN, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64, requires_grad=True)
    a, b = a.requires_grad_(), b.requires_grad_()
    index = torch.tensor([3, 0, 3])
    assert torch.autograd.gradcheck(
        lambda x, w, a, b: ref.lora_linear_multi(x, w, None, a, b, scales, index), (x, w, a, b)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "seq", "index"), shapes([(1, 1, [2]), (6, 5, [2, 0, 3, 2, 1, 3])], [(16, 257, [3, 1] * 8)])
)
def test_segmented_op_matches_reference(
    dtype: torch.dtype, batch: int, seq: int, index: list[int], record_property: Recorder
) -> None:
    """bf16 or fp32 base with fp32 adapter stacks, as serving keeps them; forward and dx."""
    a, b, scales, _ = _stacks(torch.Generator().manual_seed(2))
    a, b, scales = a.float().cuda(), b.float().cuda(), scales.float().cuda()
    x = randn(batch, seq, IN, dtype=dtype, grad=True)
    w = randn(OUT, IN, dtype=dtype, scale=IN**-0.5)
    bias = randn(OUT, dtype=dtype)
    idx = torch.tensor(index, device="cuda")

    def reference(x: torch.Tensor) -> torch.Tensor:
        w_, bias_, a_, b_ = (t.to(x.dtype) for t in (w, bias, a, b))
        return ref.lora_linear_multi(x, w_, bias_, a_, b_, scales, idx)

    assert_matches_reference(
        lambda x: lora_multi.lora_linear_multi(x, w, bias, a, b, scales, idx), reference,
        [x], torch.randn(batch, seq, OUT, device="cuda"), ["y", "dx"], dtype, record_property,
    )  # fmt: skip
