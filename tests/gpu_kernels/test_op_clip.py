"""Sync-free global-norm gradient clipping (gpu_kernels.ops.clip, csrc/clip.cu) and its
reference (gpu_kernels.ops.clip_reference), with the device-side non-finite flag.

The reference's own checks run everywhere; the compiled op against a float64 norm, many tensor
counts and sizes, needs a CUDA device (`gpu`).
"""

from __future__ import annotations

import math

import pytest
import torch

import gpu_kernels
from gpu_kernels.ops import clip
from gpu_kernels.ops import clip_reference as ref
from tests.gpu_kernels.oracle import Recorder, rel, shapes

# ------------------------------------------------------------------ the reference, fp64, on CPU


def test_clip_scales_to_max_norm_and_returns_the_norm_before() -> None:
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    p1.grad = torch.tensor([3.0, 0.0, 0.0])
    p2.grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = ref.clip_grad_norm_([p1, p2], 1.0)
    assert norm.item() == pytest.approx(5.0)
    total = torch.sqrt(p1.grad.pow(2).sum() + p2.grad.pow(2).sum())
    assert total.item() == pytest.approx(1.0, rel=1e-5)


def test_clip_records_the_first_non_finite_step_and_leaves_grads() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    state = ref.new_nonfinite_state("cpu")
    p.grad = torch.tensor([0.1, 0.2])
    ref.clip_grad_norm_([p], 1.0, state)
    p.grad = torch.tensor([float("inf"), 1.0])
    norm = ref.clip_grad_norm_([p], 1.0, state)
    p.grad = torch.tensor([float("nan"), 1.0])
    ref.clip_grad_norm_([p], 1.0, state)
    assert not torch.isfinite(norm)
    assert state.tolist() == [2, 3]  # first bad step 2 (sticky), 3 steps counted
    assert p.grad[1].item() == 1.0  # unscaled


@pytest.mark.parametrize("max_norm", [1e-3, 1.0, 1e6])
def test_reference_equals_torch_clip_grad_norm(max_norm: float) -> None:
    g = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (1, 7, 300)]
    theirs = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (1, 7, 300)]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape, generator=g, dtype=torch.float64)
        b.grad = a.grad.clone()
    norm = ref.clip_grad_norm_(ours, max_norm)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    # the reference sums squares in fp32 (the kernels' precision): fp32 agreement
    torch.testing.assert_close(norm, want.float())
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0)


# ------------------------------------------------------------ the compiled op, on a CUDA device


@pytest.mark.gpu
@pytest.mark.parametrize("max_norm", [1e-3, 1e6])
@pytest.mark.parametrize(
    ("sizes",),
    shapes([([1],), ([1, 7, 16384, 16385, 100003],), ([3] * 700,)], [([2048 * 16, 16 * 8192] * 112,)]),
)
def test_clip_matches_the_float64_norm(sizes: list[int], max_norm: float, record_property: Recorder) -> None:
    grads = [torch.randn(s, device="cuda") for s in sizes]
    before = [g.clone() for g in grads]
    gold = torch.stack([(g.double() ** 2).sum() for g in grads]).sum().sqrt()
    state = ref.new_nonfinite_state("cuda")
    norm = clip.clip_grad_norm_(grads, max_norm, state)
    coef = min(1.0, max_norm / (gold.item() + 1e-6))
    err_norm = abs(norm.item() - gold.item()) / gold.item()
    err_grads = max(rel(g, b.double() * coef) for g, b in zip(grads, before, strict=True))
    record_property("err_norm", err_norm)
    record_property("err_grads", err_grads)
    assert err_norm < 1e-5
    assert err_grads < 1e-6
    if max_norm > 1e5:  # nothing to clip: the grads are untouched, bit for bit
        assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))
    assert state.tolist() == [0, 1]


@pytest.mark.gpu
def test_clip_flags_the_first_non_finite_step_and_leaves_grads() -> None:
    grads = [torch.randn(100, device="cuda"), torch.randn(50, device="cuda")]
    state = ref.new_nonfinite_state("cuda")
    clip.clip_grad_norm_(grads, 1.0, state)
    grads[1][3] = float("inf")
    before = [g.clone() for g in grads]
    norm = clip.clip_grad_norm_(grads, 1.0, state)
    clip.clip_grad_norm_([torch.randn(10, device="cuda")], 1.0, state)
    assert not math.isfinite(norm.item())
    assert state.tolist() == [2, 3]  # first bad step 2 (sticky), 3 steps counted
    assert torch.equal(grads[0], before[0])  # unscaled


@pytest.mark.gpu
def test_dispatch_runs_the_compiled_op_on_cuda() -> None:
    ps = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in (7, 16385)]
    for p in ps:
        p.grad = torch.randn_like(p)
    expect = torch.stack([(p.grad.double() ** 2).sum() for p in ps if p.grad is not None]).sum().sqrt()
    norm = gpu_kernels.clip_grad_norm_(ps, 1.0)
    assert abs(norm.item() - expect.item()) / expect.item() < 1e-5
