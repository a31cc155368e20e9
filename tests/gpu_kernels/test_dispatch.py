"""Dispatch on CPU tensors: every public op is its reference twin; status and refusal logic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gpu_kernels
from gpu_kernels import reference

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")


@cpu_only
def test_status_without_a_gpu_names_the_reference_path() -> None:
    status = gpu_kernels.available()
    assert status.compiled is False
    assert "no CUDA device" in status.reason
    gpu_kernels.require_compiled()  # no GPU: nothing to refuse


def test_set_backend_validates() -> None:
    with pytest.raises(ValueError, match="backend must be"):
        gpu_kernels.set_backend("fast")  # type: ignore[arg-type]
    assert gpu_kernels.get_backend() in ("auto", "reference")


def test_configure_sets_every_switch_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_kernels import backend, build
    from gpu_kernels.ops import lora

    monkeypatch.setattr(backend, "_backend", "auto")  # put back after the test
    monkeypatch.setattr(lora, "_RANK_UPDATE", "epilogue")
    monkeypatch.setattr(build, "_cache_dir", None)
    assert gpu_kernels.current_config() == gpu_kernels.KernelConfig()  # the defaults: no environment read
    chosen = gpu_kernels.KernelConfig(backend="reference", rank_update="cublas", cache_dir=Path("/tmp/k"))
    gpu_kernels.configure(chosen)
    assert gpu_kernels.current_config() == chosen
    assert gpu_kernels.get_backend() == "reference" and lora._RANK_UPDATE == "cublas"
    assert build.cache_dir() == Path("/tmp/k")
    with pytest.raises(ValueError, match="rank_update must be"):
        gpu_kernels.configure(gpu_kernels.KernelConfig(rank_update="fast"))  # type: ignore[arg-type]


def test_cpu_ops_are_the_reference() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=g)
    w = torch.randn(5, 6, generator=g)
    a, b = torch.randn(2, 6, generator=g), torch.randn(5, 2, generator=g)
    assert torch.equal(
        gpu_kernels.lora_linear(x, w, None, a, b, 2.0), reference.lora_linear(x, w, None, a, b, 2.0)
    )
    ads = [(a, b[:3], 1.0), (a, b[3:], 0.5)]
    assert torch.equal(
        gpu_kernels.lora_linear_grouped(x, w, None, ads), reference.lora_linear_grouped(x, w, None, ads)
    )
    nw = torch.randn(6, generator=g)
    assert torch.equal(gpu_kernels.rms_norm(x, nw, 1e-6), reference.rms_norm(x, nw, 1e-6))
    assert torch.equal(gpu_kernels.swiglu(x, x), reference.swiglu(x, x))
    assert torch.equal(gpu_kernels.swiglu_packed(x), reference.swiglu_packed(x))
    t = torch.tensor([0, 4, -100])
    assert torch.equal(
        gpu_kernels.fused_linear_cross_entropy(x, w, t), reference.fused_linear_cross_entropy(x, w, t)
    )


def test_cpu_clip_matches_torch() -> None:
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 7)]
    qs = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 7)]
    for p, q in zip(ps, qs, strict=True):
        p.grad = torch.randn(p.shape)
        q.grad = p.grad.clone()
    ours = gpu_kernels.clip_grad_norm_(ps, 0.5)
    theirs = torch.nn.utils.clip_grad_norm_(qs, 0.5)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
