"""The plain-torch twins in gpu_kernels.reference: the CPU path and the GPU oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_kernels import reference


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
    got = reference.lora_linear_grouped(x, w, None, adapters)
    parts = []
    for (a, b, s), wj in zip(adapters, w.split(widths), strict=True):
        parts.append(reference.lora_linear(x, wj, None, a, b, s))
    assert got.shape == (2, 5, 14)
    torch.testing.assert_close(got, torch.cat(parts, -1), rtol=1e-12, atol=1e-12)


def test_grouped_lora_rejects_adapters_that_do_not_cover_the_weight() -> None:
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="cover 2 output features but weight has 5"):
        reference.lora_linear_grouped(
            x, torch.randn(5, 4), None, [(torch.randn(1, 4), torch.randn(2, 1), 1.0)]
        )


def test_rms_norm_formula_and_dtype() -> None:
    x = torch.randn(3, 7, dtype=torch.float64)
    w = torch.randn(7, dtype=torch.float64)
    expect = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(reference.rms_norm(x, w, 1e-5), expect)
    xb = x.to(torch.bfloat16)
    assert reference.rms_norm(xb, w.to(torch.bfloat16), 1e-5).dtype == torch.bfloat16


def test_swiglu_and_packed_agree() -> None:
    gu = torch.randn(4, 10, dtype=torch.float64)
    g, u = gu[:, :5], gu[:, 5:]
    torch.testing.assert_close(reference.swiglu_packed(gu), g * torch.sigmoid(g) * u)
    torch.testing.assert_close(reference.swiglu(g, u), reference.swiglu_packed(gu))


def test_fused_ce_is_mean_over_counted_targets() -> None:
    h = torch.randn(6, 8, dtype=torch.float64)
    w = torch.randn(11, 8, dtype=torch.float64)
    t = torch.tensor([1, -100, 3, 10, -100, 0])
    expect = F.cross_entropy(h @ w.t(), t, ignore_index=-100)
    torch.testing.assert_close(reference.fused_linear_cross_entropy(h, w, t), expect)
    none = torch.full((6,), -100)
    assert reference.fused_linear_cross_entropy(h, w, none).item() == 0.0  # not NaN


def test_clip_scales_to_max_norm_and_returns_the_norm_before() -> None:
    p1, p2 = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    p1.grad = torch.tensor([3.0, 0.0, 0.0])
    p2.grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    norm = reference.clip_grad_norm_([p1, p2], 1.0)
    assert norm.item() == pytest.approx(5.0)
    total = torch.sqrt(p1.grad.pow(2).sum() + p2.grad.pow(2).sum())
    assert total.item() == pytest.approx(1.0, rel=1e-5)


def test_clip_records_the_first_non_finite_step_and_leaves_grads() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    state = reference.new_nonfinite_state("cpu")
    p.grad = torch.tensor([0.1, 0.2])
    reference.clip_grad_norm_([p], 1.0, state)
    p.grad = torch.tensor([float("inf"), 1.0])
    norm = reference.clip_grad_norm_([p], 1.0, state)
    p.grad = torch.tensor([float("nan"), 1.0])
    reference.clip_grad_norm_([p], 1.0, state)
    assert not torch.isfinite(norm)
    assert state.tolist() == [2, 3]  # first bad step 2 (sticky), 3 steps counted
    assert p.grad[1].item() == 1.0  # unscaled


def test_dropout_mask_matches_the_cuda_hash() -> None:
    # values of csrc/lora.cu's hash32 chain for seed 7, salt 3, indices 0..5 (computed with the
    # same C code compiled by gcc): the reference must reproduce the GPU mask bit for bit
    key_hashes = [180273132, 1041190268, 3099286096, 1083214138, 1497210757, 4034528124]
    keep = reference.dropout_mask(6, 0.3, seed=7, salt=3)
    assert keep.tolist() == [(h >> 8) >= int(0.3 * 2**24) for h in key_hashes]


def test_hash_dropout_keeps_about_1_minus_p_and_rescales() -> None:
    x = torch.ones(100_000)
    y = reference.hash_dropout(x, 0.25, seed=1, salt=2)
    kept = (y != 0).float().mean().item()
    assert kept == pytest.approx(0.75, abs=0.01)
    torch.testing.assert_close(y[y != 0], torch.full_like(y[y != 0], 1 / 0.75))
    assert torch.equal(y, reference.hash_dropout(x, 0.25, seed=1, salt=2))
    assert not torch.equal(y, reference.hash_dropout(x, 0.25, seed=2, salt=2))


def test_rope_qkv_matches_hugging_face_rotary_embedding() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(5)
    b, s, heads, kv, d = 2, 7, 6, 2, 10
    qkv = torch.randn(b, s, (heads + 2 * kv) * d, generator=g, dtype=torch.float64)
    angles = torch.randn(b, s, d // 2, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = reference.rope_qkv(qkv, cos, sin, heads, kv)
    hf_q, hf_k, hf_v = (t.transpose(1, 2) for t in qkv.view(b, s, -1, d).split([heads, kv, kv], dim=2))
    want_q, want_k = apply_rotary_pos_emb(hf_q, hf_k, cos, sin)
    assert (q.shape, k.shape, v.shape) == ((b, heads, s, d), (b, kv, s, d), (b, kv, s, d))
    torch.testing.assert_close(q, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, want_k, rtol=1e-12, atol=1e-12)
    assert torch.equal(v, hf_v)


def test_rope_qkv_names_a_width_that_is_not_whole_heads() -> None:
    qkv = torch.zeros(1, 2, 6 * 8 + 1)  # 4 q heads + 2·1 kv heads of 8, one feature too many
    cos = sin = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match=r"width 49 is not a whole number of heads"):
        reference.rope_qkv(qkv, cos, sin, 4, 1)
    assert reference.rope_head_size(48, 4, 1) == 8
