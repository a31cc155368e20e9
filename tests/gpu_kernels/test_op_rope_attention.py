"""The q/k norm, RoPE and variable-length attention as one op (gpu_kernels.ops.rope_attention),
which keeps the projected q/k/v rows for the backward and rotates them again there.

On the CPU, `gpu_kernels.rope_attention` is the two reference ops in a row (checked here in
fp64 against them written out). On a CUDA device (`gpu`): the one op against the reference in
bf16, forward and backward, for Qwen3's and Gemma 3's heads (offset 0 and 1, a window, packed
positions); its output equal bit for bit to the two compiled ops'; and what it saves for the
backward: exactly one q/k/v tensor fewer than the two ops.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import gpu_kernels
from gpu_kernels.ops import rope, rope_attention, varlen
from gpu_kernels.ops import rope_reference as rope_ref
from gpu_kernels.ops import varlen_reference as varlen_ref
from tests.gpu_kernels.oracle import Recorder, assert_matches_reference, rope_tables, saved_storages, shapes
from tests.gpu_kernels.test_op_rope import packed_positions


def offsets_of(positions: torch.Tensor) -> torch.Tensor:
    """(K + 1,) int32 offsets of the sequences of packed rows (B, S): one starts wherever a
    position is 0, and the rows lie one after another."""
    starts = torch.nonzero(positions.reshape(-1) == 0).flatten()
    end = torch.tensor([positions.numel()], device=positions.device)
    return torch.cat([starts, end]).to(torch.int32)


def composed(
    rope_qkv: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    attention: Callable[..., torch.Tensor],
    qkv: torch.Tensor,
    tables: tuple[torch.Tensor, torch.Tensor],
    heads: int,
    kv: int,
    positions: torch.Tensor | None,
    norm: rope_ref.HeadNorm,
    cu: torch.Tensor,
    max_seqlen: int,
    window: int | None,
) -> torch.Tensor:
    """The two ops in a row: (B·S, H, D)."""
    q, k, v = rope_qkv(qkv, *tables, heads, kv, positions, norm)
    return attention(*(rope_ref.packed_rows(t) for t in (q, k, v)), cu, max_seqlen, None, window)


def head_norm(d: int, offset: float, dtype: torch.dtype, device: str) -> rope_ref.HeadNorm:
    g = torch.Generator(device=device).manual_seed(d)
    base = 0.0 if offset else 1.0
    w = [(0.3 * torch.randn(d, generator=g, device=device) + base).to(dtype) for _ in "qk"]
    return rope_ref.HeadNorm(w[0], w[1], 1e-6, offset)


def test_on_the_cpu_it_is_the_two_reference_ops() -> None:
    """fp64: the dispatch's output and gradient equal the reference rope_qkv then the reference
    varlen attention; with positions and a window."""
    torch.manual_seed(0)
    b, s, heads, kv, d = 2, 9, 4, 2, 8
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_tables(1, s, d, torch.float64, device="cpu")
    positions = packed_positions(b, s, seed=3)
    cu, norm = offsets_of(positions), head_norm(d, 1.0, torch.float64, "cpu")
    got = gpu_kernels.rope_attention(
        qkv, cos, sin, heads, kv, cu, s, positions=positions, norm=norm, window=3
    )
    want = composed(
        rope_ref.rope_qkv, varlen_ref.varlen_attention, qkv, (cos, sin), heads, kv, positions, norm, cu, s, 3
    )
    gy = torch.randn_like(got)
    (g_got,) = torch.autograd.grad(got, qkv, gy)
    (g_want,) = torch.autograd.grad(want, qkv, gy)
    assert torch.equal(got, want) and torch.equal(g_got, g_want)


# (B, S, H, G, D, norm offset, window): Qwen3's heads; Gemma 3's 256 with (1 + w) and a window;
# the large ones at the real models' head counts
SHAPES = shapes(
    [(2, 37, 4, 2, 128, 0.0, None), (2, 53, 4, 1, 256, 1.0, 16)],
    [(2, 2048, 32, 8, 128, 0.0, None), (4, 2048, 4, 1, 256, 1.0, 512)],
)


@pytest.mark.gpu
@pytest.mark.parametrize("by_position", [False, True], ids=["per_row", "by_position"])
@pytest.mark.parametrize(("b", "s", "heads", "kv", "d", "offset", "window"), SHAPES)
def test_one_op_matches_the_reference(
    b: int, s: int, heads: int, kv: int, d: int, offset: float, window: int | None, by_position: bool,
    record_property: Recorder,
) -> None:  # fmt: skip
    """bf16 against the reference ops in fp64 (the oracle's bounds), forward and the gradient of
    the projected rows; and the forward equal bit for bit to the two compiled ops'."""
    dtype = torch.bfloat16
    qkv = (torch.randn(b, s, (heads + 2 * kv) * d, device="cuda") * 2).to(dtype).requires_grad_()
    cos, sin = rope_tables(1 if by_position else b, s, d, dtype)
    positions = packed_positions(b, s, seed=d + s, device="cuda") if by_position else None
    cu = (
        offsets_of(positions)
        if positions is not None
        else torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    )
    norm = head_norm(d, offset, dtype, "cuda")

    def one(t: torch.Tensor) -> torch.Tensor:
        return rope_attention.rope_varlen_attention(
            t,
            cos,
            sin,
            heads,
            kv,
            positions,
            norm.q_weight,
            norm.k_weight,
            norm.eps,
            norm.offset,
            cu,
            s,
            None,
            window,
        )

    def reference(t: torch.Tensor) -> torch.Tensor:
        tables, hn = (
            (cos.to(t.dtype), sin.to(t.dtype)),
            norm._replace(q_weight=norm.q_weight.to(t.dtype), k_weight=norm.k_weight.to(t.dtype)),
        )
        return composed(
            rope_ref.rope_qkv, varlen_ref.varlen_attention, t, tables, heads, kv, positions, hn, cu, s, window
        )

    assert_matches_reference(
        one,
        reference,
        [qkv],
        torch.randn(b * s, heads, d, device="cuda"),
        ["attn", "dqkv"],
        dtype,
        record_property,
    )
    two_ops = composed(
        rope.rope_qkv, varlen.varlen_attention, qkv, (cos, sin), heads, kv, positions, norm, cu, s, window
    )
    assert torch.equal(one(qkv), two_ops)


def saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct tensors autograd saves for the backward while `fn` runs."""
    with saved_storages() as seen:
        fn()
    return sum(seen.values())


@pytest.mark.gpu
def test_one_op_saves_one_q_k_v_tensor_less_than_two() -> None:
    """Two ops keep the projected rows (for the norm's backward) and the normalised, rotated
    q/k/v (for flash attention's); the one op keeps the first only: (H + 2G)·D·B·S bf16 less."""
    b, s, heads, kv, d = 2, 512, 16, 8, 128
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_tables(b, s, d, torch.bfloat16)
    cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
    norm = head_norm(d, 0.0, torch.bfloat16, "cuda")
    two = saved_bytes(
        lambda: composed(
            rope.rope_qkv, varlen.varlen_attention, qkv, (cos, sin), heads, kv, None, norm, cu, s, None
        )
    )
    one = saved_bytes(lambda: gpu_kernels.rope_attention(qkv, cos, sin, heads, kv, cu, s, norm=norm))
    assert two - one == qkv.numel() * qkv.element_size()
