"""Rotary embedding fused with the q/k/v split (gpu_kernels.ops.rope, csrc/rope.cu) and its
reference (gpu_kernels.ops.rope_reference).

The reference's own fp64 checks run everywhere (against Hugging Face's rotary embedding and a
rotation written out per pair); the compiled op against the reference, forward and backward, in
fp32 and bf16, alone, under attention and reading one table by packed positions, needs a CUDA
device (`gpu`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from gpu_kernels.ops import rope
from gpu_kernels.ops import rope_reference as ref
from tests.gpu_kernels.oracle import DTYPES, Recorder, assert_matches_reference, randn, rope_tables, shapes

# rope.rope_qkv and its reference: (qkv, cos, sin, n_heads, n_kv_heads) -> (q, k, v)
RopeQkv = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
]
# the same with positions: None, or (B, S) at which one (1, P, D) table is read
RopeQkvAt = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]

# ------------------------------------------------------------------ the reference, fp64, on CPU


def test_rope_qkv_matches_hugging_face_rotary_embedding() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(5)
    b, s, heads, kv, d = 2, 7, 6, 2, 10
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64)
    angles = torch.randn(b, s, d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = ref.rope_qkv(qkv, cos, sin, heads, kv)
    hf_q, hf_k, hf_v = (t.transpose(1, 2) for t in qkv.view(b, s, -1, d).split([heads, kv, kv], dim=2))
    want_q, want_k = apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
    assert (q.shape, k.shape, v.shape) == ((b, heads, s, d), (b, kv, s, d), (b, kv, s, d))
    torch.testing.assert_close(q, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, want_k, rtol=1e-12, atol=1e-12)
    assert torch.equal(v, hf_v)


def test_rope_rotates_each_pair_i_and_i_plus_half_by_its_angle() -> None:
    """Independent of rotate_half: feature pairs (i, i + D/2) rotated as 2-vectors, one by one."""
    g = torch.Generator().manual_seed(6)
    s, d = 3, 4
    qkv = torch.randn(1, s, 3 * d, generator=g, dtype=torch.float64)
    angles = torch.randn(1, s, d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, _ = ref.rope_qkv(qkv, cos, sin, 1, 1)
    for head, got in ((0, q), (1, k)):
        for t in range(s):
            for i in range(d // 2):
                x0, x1 = qkv[0, t, head * d + i].item(), qkv[0, t, head * d + i + d // 2].item()
                c, sn = angles[0, t, i].cos().item(), angles[0, t, i].sin().item()
                assert got[0, 0, t, i].item() == pytest.approx(x0 * c - x1 * sn, abs=1e-12)
                assert got[0, 0, t, i + d // 2].item() == pytest.approx(x1 * c + x0 * sn, abs=1e-12)


def test_reference_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(7)
    b, s, heads, kv, d = 2, 3, 2, 1, 4
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(1, s, d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    assert torch.autograd.gradcheck(lambda t: ref.rope_qkv(t, cos, sin, heads, kv), (qkv,))


def packed_positions(b: int, s: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """(b, s) int64 positions of packed rows: each row holds sequences of random lengths, and
    positions restart at 0 at every sequence start."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        row: list[int] = []
        while len(row) < s:
            row += range(int(torch.randint(1, s + 1, (1,), generator=g)))
        rows.append(row[:s])
    return torch.tensor(rows, dtype=torch.int64, device=device)


def test_positions_read_one_table_as_per_row_tables_would() -> None:
    """Packed rows: one (1, P, D) table read at each token's position gives what the (B, S, D)
    tables gathered from it give, forward and backward (fp64)."""
    g = torch.Generator().manual_seed(8)
    b, s, heads, kv, d = 3, 11, 4, 2, 6
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(1, s, d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (1, S, D)
    positions = packed_positions(b, s, seed=9)
    assert positions.max() < s and (positions == 0).sum() > b  # rows hold several sequences
    got = torch.cat([t.reshape(-1) for t in ref.rope_qkv(qkv, cos, sin, heads, kv, positions)])
    rows_cos, rows_sin = cos[0][positions], sin[0][positions]  # (B, S, D)
    want = torch.cat([t.reshape(-1) for t in ref.rope_qkv(qkv, rows_cos, rows_sin, heads, kv)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda t: ref.rope_qkv(t, cos, sin, heads, kv, positions), (qkv,))


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_head_norm_matches_the_families_q_k_norm(family: str) -> None:
    """Qwen3's and Gemma 3's q/k RMSNorm (Gemma's (1 + w) weights: offset 1), then RoPE, as
    transformers runs them. transformers computes the norm in float32 even on float64 inputs."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    g = torch.Generator().manual_seed(10)
    b, s, heads, kv, d = 2, 5, 4, 2, 8
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64) * 3
    angles = torch.randn(b, s, d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_norm, k_norm = (
        Gemma3RMSNorm(d, eps=1e-6) if family == "gemma3" else Qwen3RMSNorm(d, eps=1e-6) for _ in "qk"
    )
    for m in (q_norm, k_norm):
        m.double()
        torch.nn.init.normal_(m.weight, std=0.5, generator=g)
    norm = ref.HeadNorm(q_norm.weight, k_norm.weight, 1e-6, 1.0 if family == "gemma3" else 0.0)
    q, k, v = ref.rope_qkv(qkv, cos, sin, heads, kv, norm=norm)
    hf_q, hf_k, hf_v = (t.transpose(1, 2) for t in qkv.view(b, s, -1, d).split([heads, kv, kv], dim=2))
    want_q, want_k = apply_rotary_pos_emb(q_norm(hf_q), k_norm(hf_k), cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(v, hf_v)


def test_partial_rotary_matches_phi3() -> None:
    """Phi-4-mini: tables of R < D dims rotate the first R of each head, the rest pass."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(11)
    b, s, heads, kv, d, r = 2, 6, 4, 2, 16, 12
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64)
    angles = torch.randn(b, s, r // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # (B, S, R)
    q, k, _ = ref.rope_qkv(qkv, cos, sin, heads, kv)
    hf_q, hf_k, _ = (t.transpose(1, 2) for t in qkv.view(b, s, -1, d).split([heads, kv, kv], dim=2))
    want_q, want_k = apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, want_k, rtol=1e-12, atol=1e-12)
    with pytest.raises(
        ValueError, match=r"last dim 18 \(the rotated dims\) must be even, at most the head size 16"
    ):
        ref.rope_qkv(qkv, torch.zeros(1, s, 18), torch.zeros(1, s, 18), heads, kv)


def test_head_norm_and_partial_rotary_gradients_pass_gradcheck() -> None:
    g = torch.Generator().manual_seed(12)
    b, s, heads, kv, d, r = 2, 3, 2, 1, 8, 4
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64, requires_grad=True)
    angles = torch.randn(1, s, r // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_weight, k_weight = (torch.randn(d, generator=g, dtype=torch.float64) for _ in "qk")
    norm = ref.HeadNorm(q_weight, k_weight, 1e-6, 1.0)
    assert torch.autograd.gradcheck(lambda t: ref.rope_qkv(t, cos, sin, heads, kv, norm=norm), (qkv,))


def test_rope_qkv_names_a_width_that_is_not_whole_heads() -> None:
    qkv = torch.zeros(1, 2, 6 * 8 + 1)  # 4 q heads + 2·1 kv heads of 8, one feature too many
    cos = sin = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match=r"width 49 is not a whole number of heads"):
        ref.rope_qkv(qkv, cos, sin, 4, 1)
    assert ref.rope_head_size(48, 4, 1) == 8


# ------------------------------------------------------------ the compiled op, on a CUDA device

# (B, S, H q heads, G kv heads, D); B = 3 takes one cos/sin table broadcast over the batch
SHAPES = shapes(
    [(1, 1, 1, 1, 2), (2, 7, 6, 2, 10), (3, 33, 9, 3, 64), (1, 129, 32, 8, 128)],
    [(8, 1024, 9, 3, 64), (2, 2048, 32, 8, 64)],
)


@pytest.mark.gpu
@pytest.mark.parametrize("by_position", [False, True], ids=["per_row", "by_position"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "s", "heads", "kv", "d"), SHAPES)
def test_rope_qkv_matches_reference(
    dtype: torch.dtype, b: int, s: int, heads: int, kv: int, d: int, by_position: bool,
    record_property: Recorder,
) -> None:  # fmt: skip
    """Per-row tables (one broadcast over the batch when B = 3), or packed rows: one (1, S, D)
    table read at positions that restart per sequence."""
    qkv = randn(b, s, (heads + 2 * kv) * d, dtype=dtype, grad=True)
    cos, sin = rope_tables(1 if b == 3 or by_position else b, s, d, dtype)
    positions = packed_positions(b, s, seed=b * s, device="cuda") if by_position else None

    def flat(fn: RopeQkvAt, t: torch.Tensor) -> torch.Tensor:
        q, k, v = fn(t, cos.to(t.dtype), sin.to(t.dtype), heads, kv, positions)
        return torch.cat([q.reshape(-1), k.reshape(-1), v.reshape(-1)])

    assert_matches_reference(
        lambda t: flat(rope.rope_qkv, t), lambda t: flat(ref.rope_qkv, t),
        [qkv], torch.randn(qkv.numel(), device="cuda"), ["qkv_out", "dqkv"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "s", "heads", "kv", "d"), SHAPES)
def test_rope_qkv_under_attention_matches_reference(
    dtype: torch.dtype, b: int, s: int, heads: int, kv: int, d: int, record_property: Recorder
) -> None:
    """As the fused attention uses it: the gradients arrive in SDPA's own strides."""
    qkv = randn(b, s, (heads + 2 * kv) * d, dtype=dtype, grad=True)
    cos, sin = rope_tables(1 if b == 3 else b, s, d, dtype)

    def attend(fn: RopeQkv, t: torch.Tensor) -> torch.Tensor:
        q, k, v = fn(t, cos.to(t.dtype), sin.to(t.dtype), heads, kv)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv)

    assert_matches_reference(
        lambda t: attend(rope.rope_qkv, t), lambda t: attend(ref.rope_qkv, t),
        [qkv], torch.randn(b, heads, s, d, device="cuda"), ["attn", "dqkv"], dtype, record_property,
    )  # fmt: skip


# (D, R, norm offset or None): Qwen3 / Llama-8B heads with q/k norm; Gemma's 256 with (1 + w);
# Phi-4-mini's partial rotary (96 of 128); tiny heads (D = 8, R = 6) on the scalar path
FAMILY_HEADS = [
    pytest.param(128, 128, 0.0, id="qwen3"),
    pytest.param(256, 256, 1.0, id="gemma3"),
    pytest.param(128, 96, None, id="phi4mini"),
    pytest.param(8, 6, None, id="tiny-partial"),
    pytest.param(8, 8, 1.0, id="tiny-norm"),
    pytest.param(64, 48, 0.0, id="norm-partial"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("by_position", [False, True], ids=["per_row", "by_position"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "r", "offset"), FAMILY_HEADS)
def test_rope_qkv_family_variants_match_reference(
    dtype: torch.dtype, d: int, r: int, offset: float | None, by_position: bool, record_property: Recorder
) -> None:
    """Per-head q/k norm (offset 0 or 1) and partial rotary in the kernel, forward and backward,
    under attention as the fused attention uses them (gradients in SDPA's strides)."""
    b, s, heads, kv = 2, 37, 4, 2
    qkv = randn(b, s, (heads + 2 * kv) * d, dtype=dtype, grad=True, scale=2.0)
    cos, sin = rope_tables(1 if by_position else b, s, r, dtype)
    positions = packed_positions(b, s, seed=d + r, device="cuda") if by_position else None
    norm = None
    if offset is not None:
        weights = [(0.3 * torch.randn(d, device="cuda") + (0.0 if offset else 1.0)).to(dtype) for _ in "qk"]
        norm = ref.HeadNorm(weights[0], weights[1], 1e-6, offset)
        assert rope.norm_fits(d, r)

    def attend(fn: Callable[..., tuple[torch.Tensor, ...]], t: torch.Tensor) -> torch.Tensor:
        tables = (cos.to(t.dtype), sin.to(t.dtype))
        hn = (
            norm._replace(q_weight=norm.q_weight.to(t.dtype), k_weight=norm.k_weight.to(t.dtype))
            if norm
            else None
        )
        q, k, v = fn(t, *tables, heads, kv, positions, hn)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    assert_matches_reference(
        lambda t: attend(rope.rope_qkv, t), lambda t: attend(ref.rope_qkv, t),
        [qkv], torch.randn(b, heads, s, d, device="cuda"), ["attn", "dqkv"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
def test_rope_qkv_by_position_checks_the_table_shape() -> None:
    qkv = torch.zeros(2, 4, 3 * 8, device="cuda")
    cos = sin = torch.zeros(2, 4, 8, device="cuda")
    with pytest.raises(ValueError, match=r"read by position must both be \(1, P, R\)"):
        rope.rope_qkv(qkv, cos, sin, 1, 1, torch.zeros(2, 4, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=r"positions must be \(2, 4\)"):
        rope.rope_qkv(qkv, cos[:1], sin[:1], 1, 1, torch.zeros(4, dtype=torch.int64, device="cuda"))


@pytest.mark.gpu
def test_rope_qkv_rejects_an_odd_head_size() -> None:
    qkv = torch.zeros(1, 2, 3 * 5, device="cuda")
    cos = sin = torch.zeros(1, 2, 5, device="cuda")
    with pytest.raises(ValueError, match="must be even"):
        rope.rope_qkv(qkv, cos, sin, 1, 1)
