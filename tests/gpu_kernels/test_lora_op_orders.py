"""The LoRA op's three orders of adding the LoRA term agree with the reference.

The "epilogue" (LoRA term first, base GEMM with beta = 1) and "cublas" (base GEMM first, rank
update after) orders are plain torch GEMMs, so the op's forward and backward are checked here on
the CPU in fp64 (with dropout, its hash mask by the reference twin); the GPU run of the same
checks, and of the "kernel" order, is test_op_lora.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from gpu_kernels import reference
from gpu_kernels.ops import lora as lora_ops
from gpu_kernels.ops.lora import RankUpdate
from tests.gpu_kernels.oracle import saved_storages


@pytest.fixture
def rank_update() -> Iterator[Callable[[RankUpdate], None]]:
    """Sets the order through the op's own switch (what gpu_kernels.configure calls); restores it."""
    before = lora_ops.get_rank_update()
    yield lora_ops.set_rank_update
    lora_ops.set_rank_update(before)


def _case(
    widths: list[int], ranks: list[int], bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(sum(widths) * 7 + len(ranks))
    k = 29
    x = torch.randn(3, 11, k, generator=g, dtype=torch.float64)
    w = torch.randn(sum(widths), k, generator=g, dtype=torch.float64)
    b = torch.randn(sum(widths), generator=g, dtype=torch.float64) if bias else None
    ab = [
        t
        for n, r in zip(widths, ranks, strict=True)
        for t in (
            torch.randn(r, k, generator=g, dtype=torch.float64),
            torch.randn(n, r, generator=g, dtype=torch.float64),
        )
    ]
    dy = torch.randn(3, 11, sum(widths), generator=g, dtype=torch.float64)
    return x, w, b, dy, ab


@pytest.mark.parametrize("order", ["epilogue", "cublas"])
@pytest.mark.parametrize(("widths", "ranks", "bias"), [([37], [4], False), ([40, 12, 12], [4, 3, 5], True)])
def test_lora_op_matches_reference(
    order: RankUpdate,
    widths: list[int],
    ranks: list[int],
    bias: bool,
    rank_update: Callable[[RankUpdate], None],
) -> None:
    rank_update(order)
    scales = [0.5, 2.0, 1.5][: len(widths)]
    x, w, b, dy, ab = _case(widths, ranks, bias)
    grads = []
    for fn in (lora_ops.lora_linear_grouped, reference.lora_linear_grouped):
        leaves = [t.clone().requires_grad_(True) for t in (x, *ab)]
        adapters = [(leaves[1 + 2 * j], leaves[2 + 2 * j], s) for j, s in enumerate(scales)]
        y = fn(leaves[0], w, b, adapters)
        y.backward(dy)
        grads.append([y.detach(), *(t.grad for t in leaves)])
    for ours, ref in zip(*grads, strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)


def test_epilogue_order_is_used_only_when_the_gemm_keeps_the_dtype(
    rank_update: Callable[[RankUpdate], None],
) -> None:
    rank_update("epilogue")
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert lora_ops._accumulates_in_epilogue(x, torch.zeros(3, 4, dtype=torch.bfloat16))
    assert not lora_ops._accumulates_in_epilogue(x, torch.zeros(3, 4))  # fp32 weight: F.linear path
    assert not lora_ops._accumulates_in_epilogue(x, torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(3))
    with torch.autocast("cpu", dtype=torch.float16):  # autocast would cast: addmm_ would not
        assert not lora_ops._accumulates_in_epilogue(x, torch.zeros(3, 4, dtype=torch.bfloat16))
    rank_update("cublas")
    assert not lora_ops._accumulates_in_epilogue(x, torch.zeros(3, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("order", ["epilogue", "cublas"])
def test_lora_op_with_dropout_matches_the_masked_formula(
    order: RankUpdate, rank_update: Callable[[RankUpdate], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dropout path with the compiled mask stood in by its reference twin (test_op_lora.py shows
    the kernel's mask equals reference.dropout_mask exactly): y = x·Wᵀ + b + Σ s_j·(drop(x)·A_jᵀ)·B_jᵀ,
    where forward and backward must draw the same mask."""
    masks: list[torch.Tensor] = []

    def hash_dropout(x: torch.Tensor, p: float, seed: torch.Tensor, salt: int) -> torch.Tensor:
        keep = reference.dropout_mask(x.numel(), p, int(seed), salt).view(x.shape)
        masks.append(keep)
        return torch.where(keep, x / (1.0 - p), 0.0)

    rank_update(order)
    monkeypatch.setattr(lora_ops, "dropout", hash_dropout)
    p, scales = 0.3, [0.5, 2.0, 1.5]
    x, w, b, dy, ab = _case([40, 12, 12], [4, 3, 5], True)
    assert b is not None
    leaves = [t.clone().requires_grad_(True) for t in (x, *ab)]
    adapters = [(leaves[1 + 2 * j], leaves[2 + 2 * j], s) for j, s in enumerate(scales)]
    y = lora_ops.lora_linear_grouped(leaves[0], w, b, adapters, dropout_p=p, training=True)
    y.backward(dy)
    ours = [y.detach(), *(t.grad for t in leaves)]
    # drop(x) in the forward, then the backward's masked U·A and regenerated drop(x): one mask
    assert len(masks) == 3 and all(torch.equal(m, masks[0]) for m in masks[1:])

    ref_leaves = [t.clone().requires_grad_(True) for t in (x, *ab)]
    xd = torch.where(masks[0].view(x.shape), ref_leaves[0] / (1.0 - p), 0.0)
    lora = [s * xd @ ref_leaves[1 + 2 * j].t() @ ref_leaves[2 + 2 * j].t() for j, s in enumerate(scales)]
    y_ref = ref_leaves[0] @ w.t() + b + torch.cat(lora, dim=-1)
    y_ref.backward(dy)
    for got, want in zip(ours, [y_ref.detach(), *(t.grad for t in ref_leaves)], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_lora_op_on_a_norm_output_keeps_the_norm_input_and_gives_the_same_gradients(
    offset: float, rank_update: Callable[[RankUpdate], None]
) -> None:
    """Fed n = RMSNorm(h) with n's NormSource (what gpu_kernels.add_rms_norm returns), the op keeps
    h and rstd instead of n, and forms dA = ((U ⊙ rstd)ᵀ·h) ⊙ (offset + w): in fp64 the output and
    every gradient, h's through n included, equal the reference op's on n; n is not kept."""
    from gpu_kernels.ops.norm_source import NormSource

    rank_update("epilogue")
    scales = [0.5, 2.0, 1.5]
    h0, w, b, dy, ab = _case([40, 12, 12], [4, 3, 5], False)
    g = torch.Generator().manual_seed(5)
    norm_w = torch.randn(h0.shape[-1], generator=g, dtype=torch.float64)
    runs = []
    for fn in (lora_ops.lora_linear_grouped, reference.lora_linear_grouped):
        leaves = [t.clone().requires_grad_(True) for t in (h0, *ab)]
        h = leaves[0]
        rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)  # (3, 11)
        n = (offset + norm_w) * h * rstd[..., None]
        adapters = [(leaves[1 + 2 * j], leaves[2 + 2 * j], s) for j, s in enumerate(scales)]
        with saved_storages() as kept:
            if fn is lora_ops.lora_linear_grouped:
                x_rows, rstd_rows = h.detach().reshape(-1, h.shape[-1]), rstd.detach().reshape(-1)
                y = fn(n, w, b, adapters, source=NormSource(x_rows, rstd_rows, norm_w, offset))
            else:
                y = fn(n, w, b, adapters)
        y.backward(dy)
        runs.append(([y.detach(), *(t.grad for t in leaves)], n.untyped_storage().data_ptr() in kept))
    (ours, ours_kept_n), (want, ref_kept_n) = runs
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    assert ref_kept_n and not ours_kept_n
