"""Variable-length causal attention over packed sequences (gpu_kernels.ops.varlen: PyTorch's
flash-attention kernels) and its reference (gpu_kernels.ops.varlen_reference: one SDPA call per
sequence).

The reference's own fp64 checks run everywhere (against attention written out with a
block-diagonal causal mask); the flash op against the reference, forward and backward, in bf16
(flash attention takes 16-bit inputs only), GQA, with the zero-length sequences that pad
cu_seqlens to a fixed size, and replayed from a CUDA graph with new offsets, needs a CUDA
device (`gpu`).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import gpu_kernels
from gpu_kernels.ops import varlen
from gpu_kernels.ops import varlen_reference as ref
from tests.gpu_kernels.oracle import Recorder, assert_matches_reference, randn, rel, shapes


def cu_seqlens(lengths: list[int], pad: int = 0, device: str = "cpu") -> torch.Tensor:
    """(K + 1 + pad,) int32 offsets of sequences of `lengths`, padded with `pad` empty ones."""
    offsets = [0, *itertools.accumulate(lengths)]
    return torch.tensor(offsets + [offsets[-1]] * pad, dtype=torch.int32, device=device)


# ------------------------------------------------------------------ the reference, fp64, on CPU


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], window: int | None = None
) -> torch.Tensor:
    """softmax(q·kᵀ/√D + mask)·v over all N tokens at once, the mask allowing token j for token
    i only within i's sequence and j <= i (and i - j < window, given one); k/v heads repeated for
    GQA. (N, H, D)."""
    n, heads, d = q.shape
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # (N,)
    pos = torch.arange(n)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # (N, N)
    if window is not None:
        allowed &= pos[:, None] - pos[None, :] < window
    rep = heads // k.shape[1]
    kh, vh = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("ihd,jhd->hij", q, kh) / d**0.5
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, vh)


@pytest.mark.parametrize("window", [None, 1, 3, 100])
def test_reference_equals_block_diagonal_causal_attention(window: int | None) -> None:
    """With an attention window W, token i sees i - W + 1 .. i of its own sequence (Mistral,
    Gemma 3): a banded block-diagonal mask."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 9, 0, 2]
    n, heads, kv, d = sum(lengths), 4, 2, 6
    q = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, kv, d, generator=g, dtype=torch.float64) for _ in range(2))
    got = ref.varlen_attention(q, k, v, cu_seqlens(lengths, pad=2), max(lengths), window=window)
    want = naive_attention(q, k, v, lengths, window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if window == 3:  # a window that binds changes the result
        assert not torch.allclose(want, naive_attention(q, k, v, lengths))


def test_reference_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [2, 3]
    q = torch.randn(5, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(5, 1, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu = cu_seqlens(lengths)
    assert torch.autograd.gradcheck(lambda q, k, v: ref.varlen_attention(q, k, v, cu, 3), (q, k, v))


def test_reference_rejects_bad_offsets() -> None:
    q = k = v = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match="must rise from 0 to 4"):
        ref.varlen_attention(q, k, v, torch.tensor([0, 3, 2, 4], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="longer than max_seqlen 2"):
        ref.varlen_attention(q, k, v, cu_seqlens([1, 3]), 2)
    with pytest.raises(ValueError, match="window must be at least 1 token"):
        ref.varlen_attention(q, k, v, cu_seqlens([4]), 4, window=0)


# ------------------------------------------------------------ the compiled op, on a CUDA device


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("lengths", "heads", "kv", "d", "window"),
    shapes(
        [
            ([1], 1, 1, 16, None),
            ([5, 1, 17, 0], 4, 2, 16, None),
            ([5, 1, 17, 0], 4, 2, 16, 4),
            ([40, 9], 4, 1, 256, 8),
        ],
        [
            ([300, 41, 700, 128, 513, 366], 32, 8, 64, None),
            ([2004, 20, 24], 9, 3, 64, None),
            ([96, 1100], 32, 8, 128, None),
            ([300, 41, 700, 513], 32, 8, 128, 128),
            ([2004, 20], 8, 4, 256, 512),
        ],
    ),
)
def test_varlen_attention_matches_reference(
    lengths: list[int], heads: int, kv: int, d: int, window: int | None, record_property: Recorder
) -> None:
    """With an attention window, flash attention's own (left W - 1, right 0): no mask; Gemma's
    head size 256 too."""
    dtype = torch.bfloat16
    n = sum(lengths)
    cu = cu_seqlens(lengths, pad=2, device="cuda")
    q = randn(n, heads, d, dtype=dtype, grad=True)
    k, v = randn(n, kv, d, dtype=dtype, grad=True), randn(n, kv, d, dtype=dtype, grad=True)
    m = max(lengths)
    assert_matches_reference(
        lambda q, k, v: varlen.varlen_attention(q, k, v, cu, m, window=window),
        lambda q, k, v: ref.varlen_attention(q, k, v, cu, m, window=window),
        [q, k, v], torch.randn(n, heads, d, device="cuda"), ["out", "dq", "dk", "dv"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
def test_varlen_attention_matches_one_sdpa_per_sequence() -> None:
    """Flash varlen (the packed job step's attention) through dispatch against the reference,
    GQA, with empty sequences padding cu_seqlens to a fixed length as the step pads it."""
    lengths, heads, kv, d = [300, 1, 77, 0, 512], 8, 2, 64
    n = sum(lengths)
    cu = cu_seqlens(lengths, pad=2, device="cuda")
    q, k, v = (
        torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (heads, kv, kv)
    )
    out = gpu_kernels.varlen_attention(q, k, v, cu, max(lengths))
    gy = torch.randn_like(out)
    out.backward(gy)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = ref.varlen_attention(q2, k2, v2, cu, max(lengths))
    want.backward(gy.double())
    assert rel(out, want) < 2e-2
    for g, g2 in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert g is not None and g2 is not None and rel(g, g2) < 2e-2


@pytest.mark.gpu
@pytest.mark.no_memcheck
def test_varlen_attention_replays_from_a_cuda_graph() -> None:
    """Forward and backward captured once with one packing, replayed after new offsets are copied
    into the static cu_seqlens (as the job step refills it): the output of an eager call on the
    new packing bit for bit, its gradients within the backward's atomics (its dq accumulation
    order varies), and far from the first packing's."""
    n, heads, kv, d, segments = 2048, 9, 3, 64, 8
    first, second = [700, 1000, 348], [20, 2000, 28]
    q, k, v = (
        torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (heads, kv, kv)
    )
    gy = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_seqlens(first, pad=segments - len(first), device="cuda")

    def step() -> torch.Tensor:
        for t in (q, k, v):
            t.grad = None
        out = varlen.varlen_attention(q, k, v, cu, n)
        out.backward(gy)
        return out.detach()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as GraphedStep does
        stale = step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
        grads = [t.grad for t in (q, k, v)]
    cu.copy_(cu_seqlens(second, pad=segments - len(second), device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    assert torch.equal(captured, want) and rel(stale, want) > 0.1
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g is not None and t.grad is not None and rel(g, t.grad) < 1e-2
