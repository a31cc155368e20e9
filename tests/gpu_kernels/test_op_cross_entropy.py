"""Fused linear + cross-entropy (gpu_kernels.ops.cross_entropy, csrc/cross_entropy.cu) and its
reference (gpu_kernels.ops.cross_entropy_reference).

The reference's own fp64 checks run everywhere; the compiled op against the reference, loss and
hidden-state gradient, in fp32 and bf16, up to the largest vocabulary of the catalog's models,
needs a CUDA device (`gpu`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpu_kernels
from gpu_kernels.ops import cross_entropy
from gpu_kernels.ops import cross_entropy_reference as ref
from tests.gpu_kernels.oracle import DTYPES, LARGEST_VOCAB, Recorder, assert_matches_reference, randn, shapes

# ------------------------------------------------------------------ the reference, fp64, on CPU


def test_fused_ce_is_mean_over_counted_targets() -> None:
    h = torch.randn(6, 8, dtype=torch.float64)
    w = torch.randn(11, 8, dtype=torch.float64)
    t = torch.tensor([1, -100, 3, 10, -100, 0])
    expect = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    torch.testing.assert_close(ref.fused_linear_cross_entropy(h, w, t), expect)
    none = torch.full((6,), -100)
    assert ref.fused_linear_cross_entropy(h, w, none).item() == 0.0  # not NaN


def test_reference_equals_log_softmax_written_out() -> None:
    """−(logit_t − log Σ_v exp logit_v), summed over counted rows and times `scale`."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64)
    t = torch.tensor([[6, -100, 0], [2, 2, -100]])
    logits = (h @ w.t()).reshape(-1, 7)
    rows = [(i, int(c)) for i, c in enumerate(t.reshape(-1)) if c != -100]
    losses = [logits[i].exp().sum().log() - logits[i, c] for i, c in rows]
    total = torch.stack(losses).sum()
    scale = torch.tensor(0.125, dtype=torch.float64)
    torch.testing.assert_close(ref.fused_linear_cross_entropy(h, w, t), total / len(rows))
    torch.testing.assert_close(ref.fused_linear_cross_entropy(h, w, t, scale=scale), total * 0.125)


def test_reference_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 6, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([8, -100, 0, 3])
    assert torch.autograd.gradcheck(lambda h, w: ref.fused_linear_cross_entropy(h, w, t), (h, w))


@pytest.mark.parametrize(
    ("rows", "vocab"), [(5176, 49152), (5176, 128256), (2592, 128256), (8192, 32000), (9, 7)]
)
def test_auto_chunks_split_rows_evenly_within_the_byte_budget(rows: int, vocab: int) -> None:
    c = cross_entropy.auto_chunk_rows(vocab, torch.bfloat16, rows)
    chunks = -(-rows // c)
    assert c % 8 == 0 or c == rows
    assert (c - 7) * vocab * 2 <= cross_entropy.CHUNK_BYTES  # rounded up to 8 rows at most
    assert rows - (chunks - 1) * c > 0 and (chunks == 1 or rows - (chunks - 1) * c > c // 2)  # no stub tail


# ------------------------------------------------------------ the compiled op, on a CUDA device


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "d", "v"),
    shapes([(1, 16, 7), (7, 33, 101), (300, 64, 1000)], [(2500, 256, 49152), (1030, 512, LARGEST_VOCAB)]),
)
def test_fused_linear_ce_matches_reference(
    dtype: torch.dtype, n: int, d: int, v: int, record_property: Recorder
) -> None:
    """A fifth of the targets ignored (except for the one-token case); chunks of 1024 rows, so
    the large shapes span several chunks."""
    h = randn(n, d, dtype=dtype, grad=True)
    w = randn(v, d, dtype=dtype, scale=d**-0.5 * 4)
    t = torch.randint(0, v, (n,), device="cuda")
    if n > 1:
        t[torch.rand(n, device="cuda") < 0.2] = -100
    assert_matches_reference(
        lambda h: cross_entropy.fused_linear_cross_entropy(h, w, t, -100, 1024),
        lambda h: ref.fused_linear_cross_entropy(h, w.to(h.dtype), t),
        [h], None, ["loss", "dh"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_ce_in_automatic_chunks_matches_reference(
    dtype: torch.dtype, record_property: Recorder
) -> None:
    """The default chunking (auto_chunk_rows: 2,500 rows of a 49k vocabulary in even chunks)."""
    n, d, v = 2500, 256, 49152
    h = randn(n, d, dtype=dtype, grad=True)
    w = randn(v, d, dtype=dtype, scale=d**-0.5 * 4)
    t = torch.randint(0, v, (n,), device="cuda")
    t[torch.rand(n, device="cuda") < 0.2] = -100
    assert -(-n // cross_entropy.auto_chunk_rows(v, dtype, n)) >= 2
    assert_matches_reference(
        lambda h: cross_entropy.fused_linear_cross_entropy(h, w, t),
        lambda h: ref.fused_linear_cross_entropy(h, w.to(h.dtype), t),
        [h], None, ["loss", "dh"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_ce_with_scale_matches_reference(dtype: torch.dtype, record_property: Recorder) -> None:
    """The training step's form: the sum times a device scale (1 / the step's trainable tokens)."""
    h = randn(2, 37, 48, dtype=dtype, grad=True)
    w = randn(301, 48, dtype=dtype, scale=0.5)
    t = torch.randint(0, 301, (2, 37), device="cuda")
    scale = torch.tensor(1 / 100, device="cuda")
    assert_matches_reference(
        lambda h: cross_entropy.fused_linear_cross_entropy(h, w, t, -100, 16, scale=scale),
        lambda h: ref.fused_linear_cross_entropy(h, w.to(h.dtype), t, scale=scale),
        [h], None, ["loss", "dh"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_target_ignored_gives_zero_loss_and_gradient(dtype: torch.dtype) -> None:
    h = randn(5, 16, dtype=dtype, grad=True)
    w = randn(40, 16, dtype=dtype)
    t = torch.full((5,), -100, device="cuda")
    loss = cross_entropy.fused_linear_cross_entropy(h, w, t)
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad is not None and h.grad.abs().sum().item() == 0.0


@pytest.mark.gpu
def test_dispatch_runs_the_compiled_op_on_cuda_bf16() -> None:
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    head = torch.randn(1000, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    t = torch.randint(0, 1000, (64,), device="cuda")
    loss = gpu_kernels.fused_linear_cross_entropy(x, head, t)
    assert abs(loss.item() - ref.fused_linear_cross_entropy(x, head, t).item()) < 2e-2
