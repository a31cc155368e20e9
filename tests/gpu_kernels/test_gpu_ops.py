"""Compiled ops against their reference twins on a CUDA device (skipped without one; the full
check with per-dtype bounds, the sanitizer and the 50-step training comparison is
scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

import gpu_kernels
from gpu_kernels import reference

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.fixture(autouse=True)
def compiled() -> None:
    gpu_kernels.require_compiled()
    assert gpu_kernels.available().compiled


@pytest.mark.parametrize("m,k,n,r", [(37, 129, 67, 3), (256, 512, 256, 16)])
def test_lora_linear_fp32(m: int, k: int, n: int, r: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.randn(m, k, device="cuda", requires_grad=True)
    w = torch.randn(n, k, device="cuda") / k**0.5
    a = (torch.randn(r, k, device="cuda") / k**0.5).requires_grad_()
    b = torch.randn(n, r, device="cuda").requires_grad_()
    y = gpu_kernels.lora_linear(x, w, None, a, b, 2.0)
    gy = torch.randn_like(y)
    y.backward(gy)
    x2, a2, b2 = (t.detach().clone().requires_grad_() for t in (x, a, b))
    y2 = reference.lora_linear(x2, w, None, a2, b2, 2.0)
    y2.backward(gy)
    assert rel(y, y2) < 1e-5
    for g, g2 in ((x.grad, x2.grad), (a.grad, a2.grad), (b.grad, b2.grad)):
        assert g is not None and g2 is not None and rel(g, g2) < 1e-5


def test_norm_swiglu_ce_clip_bf16() -> None:
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(576, device="cuda", dtype=torch.bfloat16)
    assert rel(gpu_kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)) < 1e-2
    gu = torch.randn(64, 3072, device="cuda", dtype=torch.bfloat16)
    assert rel(gpu_kernels.swiglu_packed(gu), reference.swiglu_packed(gu)) < 1e-2
    head = torch.randn(1000, 576, device="cuda", dtype=torch.bfloat16) * 0.05
    t = torch.randint(0, 1000, (64,), device="cuda")
    loss = gpu_kernels.fused_linear_cross_entropy(x, head, t)
    assert abs(loss.item() - reference.fused_linear_cross_entropy(x, head, t).item()) < 2e-2
    ps = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in (7, 16385)]
    for p in ps:
        p.grad = torch.randn_like(p)
    expect = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in ps))  # type: ignore[union-attr]
    norm = gpu_kernels.clip_grad_norm_(ps, 1.0)
    assert abs(norm.item() - expect.item()) / expect.item() < 1e-5


def test_varlen_attention_matches_one_sdpa_per_sequence() -> None:
    """Flash varlen (the packed job step's attention) against the reference, GQA, with empty
    sequences padding cu_seqlens to a fixed length as the step pads it."""
    lengths, heads, kv, d = [300, 1, 77, 0, 512], 8, 2, 64
    n = sum(lengths)
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    cu = torch.tensor([*offsets, n, n], dtype=torch.int32, device="cuda")
    q, k, v = (
        torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (heads, kv, kv)
    )
    out = gpu_kernels.varlen_attention(q, k, v, cu, max(lengths))
    gy = torch.randn_like(out)
    out.backward(gy)
    q2, k2, v2 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.varlen_attention(q2, k2, v2, cu, max(lengths))
    ref.backward(gy.double())
    assert rel(out, ref) < 2e-2
    for g, g2 in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert g is not None and g2 is not None and rel(g, g2) < 2e-2
