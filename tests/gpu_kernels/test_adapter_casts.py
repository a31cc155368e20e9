"""AdapterCasts (gpu_kernels.ops.adapter_casts): every LoRA op's adapters in the activation
dtype, refreshed by one launch per step, handed out only inside `in_step()`.

On the CPU the torch twin of the refresh runs (fp64, the op with and without the operands
agrees exactly); on a CUDA device (`gpu`) the kernel's buffers equal the twin's bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from gpu_kernels.ops import lora as lora_ops
from gpu_kernels.ops.adapter_casts import AdapterCasts

WIDTHS, RANKS, SCALES = [40, 12, 12], [8, 4, 16], [2.0, 0.5, 1.5]


def _ops(device: str, k: int = 29, seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """Two ops: a q/k/v-like group of three adapters and a single adapter."""
    g = torch.Generator().manual_seed(seed)

    def factor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device).requires_grad_()

    group = [(factor(r, k), factor(n, r), s) for n, r, s in zip(WIDTHS, RANKS, SCALES, strict=True)]
    return [group, [(factor(4, k), factor(k, 4), 0.75)]]


def _expected(
    adapters: list[tuple[torch.Tensor, torch.Tensor, float]], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """What LoRALinearFunction builds per call without operands."""
    a_cat = torch.cat([a for a, _, _ in adapters]).detach().to(dtype)
    d = lora_ops._scaled_block_diag([b for _, b, _ in adapters], [s for _, _, s in adapters], dtype)
    return a_cat, d


def test_refresh_writes_each_ops_stacked_a_and_scaled_block_diagonal_b() -> None:
    ops = _ops("cpu")
    casts = AdapterCasts(ops, torch.float64, compiled=False)
    assert len(casts) == 2
    assert casts.operands(0) is None  # outside in_step: each op casts for itself
    with casts.in_step():
        for i, adapters in enumerate(ops):
            got = casts.operands(i)
            assert got is not None
            for have, want in zip(got, _expected(adapters, torch.float64), strict=True):
                assert torch.equal(have, want)
    assert casts.operands(1) is None


def test_refresh_follows_in_place_updates_and_refuses_moved_factors() -> None:
    ops = _ops("cpu")
    casts = AdapterCasts(ops, torch.float32, compiled=False)
    a, b, _ = ops[0][1]
    with torch.no_grad():  # what the optimizer step does
        a.add_(1.0)
        b.mul_(3.0)
    with casts.in_step():
        got = casts.operands(0)
        assert got is not None
        for have, want in zip(got, _expected(ops[0], torch.float32), strict=True):
            assert torch.equal(have, want)
    b.data = b.data.clone()  # a new address: the table would read freed memory
    with pytest.raises(RuntimeError, match="moved"), casts.in_step():
        pass


def test_factors_that_do_not_fit_are_refused() -> None:
    ops = _ops("cpu")
    with pytest.raises(ValueError, match="fp32"):
        AdapterCasts([[(ops[0][0][0].double(), ops[0][0][1], 1.0)]], torch.float32, compiled=False)
    with pytest.raises(ValueError, match="do not fit"):
        AdapterCasts([[(ops[0][0][0], ops[0][1][1], 1.0)]], torch.float32, compiled=False)


def test_the_op_with_operands_equals_the_op_without() -> None:
    """fp64 on the CPU: forward and every gradient identical, the operands only skip the casts."""
    ops = _ops("cpu")
    casts = AdapterCasts(ops, torch.float64, compiled=False)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(sum(WIDTHS), 29, generator=g, dtype=torch.float64)
    x0 = torch.randn(5, 7, 29, generator=g, dtype=torch.float64)
    dy = torch.randn(5, 7, sum(WIDTHS), generator=g, dtype=torch.float64)
    factors = [t for a, b, _ in ops[0] for t in (a, b)]

    def run(with_operands: bool) -> list[torch.Tensor]:
        for t in factors:
            t.grad = None
        x = x0.clone().requires_grad_()
        with casts.in_step():
            operands = casts.operands(0) if with_operands else None
            y = lora_ops.lora_linear_grouped(x, w, None, ops[0], operands=operands)
        y.backward(dy)
        grads = [t.grad for t in (x, *factors)]
        assert all(gr is not None for gr in grads)
        return [y.detach(), *(gr for gr in grads if gr is not None)]

    for have, want in zip(run(True), run(False), strict=True):
        assert torch.equal(have, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_writes_what_the_torch_twin_writes(dtype: torch.dtype) -> None:
    """One launch for both ops (odd widths, ranks 4-16, non-power-of-two scales): every buffer
    bit for bit equal to the twin's, D's off-diagonal blocks zero."""
    ops = _ops("cuda", k=577, seed=5)
    kernel = AdapterCasts(ops, dtype, compiled=True)
    twin = AdapterCasts(ops, dtype, compiled=False)
    with kernel.in_step(), twin.in_step():
        for i in range(len(ops)):
            have, want = kernel.operands(i), twin.operands(i)
            assert have is not None and want is not None
            for h, w in zip(have, want, strict=True):
                assert torch.equal(h, w)
