"""The mixed-adapter LoRA op of serving: the reference (gpu_kernels.ops.lora_multi_reference, BGMV,
the CPU path) against a loop of single-adapter LoRA layers, and on a CUDA device (`gpu`) the
compiled op (gpu_kernels.ops.lora_multi: csrc/lora_multi.cu for short inputs, gathered GEMMs for
long ones) against the reference.

Each row of a batch carries an adapter index; slots have different ranks (zero-padded in the
stacks) and slot 0 is "no adapter".
"""

from __future__ import annotations

import pytest
import torch

import gpu_kernels
from gpu_kernels.ops import lora_multi
from gpu_kernels.ops import lora_multi_reference as ref
from gpu_kernels.ops.lora_reference import lora_linear
from tests.gpu_kernels.oracle import (
    DTYPES,
    Recorder,
    assert_matches_reference,
    check_errors,
    randn,
    rel,
    shapes,
)

IN, OUT, R_MAX = 24, 40, 8
RANKS = [0, 2, 8, 5]  # slot 0: the base model alone


def _stacks(
    gen: torch.Generator, n_in: int = IN, n_out: int = OUT, ranks: list[int] = RANKS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple]]:
    n, r_max = len(ranks), max(ranks)
    a = torch.zeros(n, r_max, n_in, dtype=torch.float64)
    b = torch.zeros(n, n_out, r_max, dtype=torch.float64)
    scales = torch.zeros(n, dtype=torch.float64)
    singles = []  # (A (r, in), B (out, r), s) unpadded, per slot
    for i, r in enumerate(ranks):
        ai = torch.randn(r, n_in, generator=gen, dtype=torch.float64)
        bi = torch.randn(n_out, r, generator=gen, dtype=torch.float64)
        si = 0.0 if r == 0 else 16.0 / r
        a[i, :r], b[i, :, :r], scales[i] = ai, bi, si
        singles.append((ai, bi, si))
    return a, b, scales, singles


def test_mixed_batch_equals_each_row_with_its_own_adapter() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, IN, generator=gen, dtype=torch.float64)  # (B, S, in)
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    bias = torch.randn(OUT, generator=gen, dtype=torch.float64)
    a, b, scales, singles = _stacks(gen)
    index = torch.tensor([2, 0, 3, 2, 1, 3])

    y = gpu_kernels.lora_linear_multi(x, w, bias, a, b, scales, index)  # the reference on the CPU

    assert y.shape == (6, 5, OUT)
    for row, slot in enumerate(index.tolist()):
        ai, bi, si = singles[slot]
        if RANKS[slot] == 0:
            expected = torch.nn.functional.linear(x[row], w, bias)
        else:
            expected = lora_linear(x[row], w, bias, ai, bi, si)
        torch.testing.assert_close(y[row], expected, rtol=1e-12, atol=1e-12)


def test_adapter_rows_differ_from_base_rows() -> None:
    """A non-zero adapter changes its rows (the test above would pass for an op ignoring A, B if
    every slot were zero)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, IN, generator=gen, dtype=torch.float64).expand(2, 3, IN).contiguous()
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64)
    a, b, scales, _ = _stacks(gen)
    y = gpu_kernels.lora_linear_multi(x, w, None, a, b, scales, torch.tensor([0, 2]))
    assert (y[0] - y[1]).abs().max() > 1e-3


def test_reference_gradients_pass_gradcheck() -> None:
    gen = torch.Generator().manual_seed(4)
    a, b, scales, _ = _stacks(gen)
    x = torch.randn(3, 2, IN, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(OUT, IN, generator=gen, dtype=torch.float64, requires_grad=True)
    a, b = a.requires_grad_(), b.requires_grad_()
    index = torch.tensor([3, 0, 3])
    assert torch.autograd.gradcheck(
        lambda x, w, a, b: ref.lora_linear_multi(x, w, None, a, b, scales, index), (x, w, a, b)
    )


def _cuda_stacks(n_in: int, n_out: int, ranks: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 CUDA stacks, as serving keeps them (any activation dtype)."""
    a, b, scales, _ = _stacks(torch.Generator().manual_seed(2), n_in, n_out, ranks)
    return a.float().cuda(), b.float().cuda(), scales.float().cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "seq", "index", "n_in", "n_out", "ranks"),
    shapes(
        [
            (1, 1, [2], IN, OUT, RANKS),  # one row
            (6, 5, [2, 0, 3, 2, 1, 3], IN, OUT, RANKS),  # slot 0 rows mixed in, ranks padded to 8
            (32, 1, [1, 2, 3, 0] * 8, 2048, 512, [0, 16, 16, 16]),  # a decode step, vector loads
            (5, 1, [3, 1, 0, 2, 3], 37, 53, [0, 3, 17, 5]),  # odd features, rank 17 (template 32)
            (3, 2, [1, 2, 1], 1030, 65, [0, 40, 64]),  # rank 64, K over one chunk but not two
        ],
        [(16, 257, [3, 1] * 8, IN, OUT, RANKS), (64, 8, [1, 2, 3, 0] * 16, 8192, 2048, [0, 16, 8, 16])],
    ),
)
def test_compiled_op_matches_reference(
    dtype: torch.dtype, batch: int, seq: int, index: list[int], n_in: int, n_out: int, ranks: list[int],
    record_property: Recorder,
) -> None:  # fmt: skip
    """bf16 or fp32 base with fp32 adapter stacks; forward and dx. Inputs of up to
    KERNEL_MAX_TOKENS tokens run the kernel, longer ones the gathered GEMMs."""
    a, b, scales = _cuda_stacks(n_in, n_out, ranks)
    x = randn(batch, seq, n_in, dtype=dtype, grad=True)
    w = randn(n_out, n_in, dtype=dtype, scale=n_in**-0.5)
    bias = randn(n_out, dtype=dtype)
    idx = torch.tensor(index, device="cuda")

    def reference(x: torch.Tensor) -> torch.Tensor:
        w_, bias_, a_, b_ = (t.to(x.dtype) for t in (w, bias, a, b))
        return ref.lora_linear_multi(x, w_, bias_, a_, b_, scales, idx)

    assert_matches_reference(
        lambda x: lora_multi.lora_linear_multi(x, w, bias, a, b, scales, idx), reference,
        [x], torch.randn(batch, seq, n_out, device="cuda"), ["y", "dx"], dtype, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "seq", "n_in", "n_out"), shapes([(4, 33, 24, 40)], [(32, 256, 2048, 2048), (8, 300, 8192, 61)])
)
def test_kernel_on_long_inputs_matches_reference(
    dtype: torch.dtype, batch: int, seq: int, n_in: int, n_out: int, record_property: Recorder
) -> None:
    """The kernel itself on prefill-sized inputs (T = B·S tokens, a row's tokens share its slot),
    which the op hands to the gathered GEMMs: both forms stay correct for every T."""
    ranks = [0, 16, 4, 16]
    a, b, scales = _cuda_stacks(n_in, n_out, ranks)
    x = randn(batch, seq, n_in, dtype=dtype)
    w = randn(n_out, n_in, dtype=dtype, scale=n_in**-0.5)
    idx = torch.tensor([i % len(ranks) for i in range(batch)], device="cuda")
    gold = ref.lora_linear_multi(x.double(), w.double(), None, a.double(), b.double(), scales.double(), idx)
    same = ref.lora_linear_multi(x, w, None, a.to(dtype), b.to(dtype), scales, idx)
    errs, ref_errs = {}, {}
    for name, add in (("kernel", lora_multi.kernel_add_), ("gathered", lora_multi.gathered_add_)):
        y = torch.nn.functional.linear(x, w)
        add(y, x, a, b, scales, idx)
        errs[name], ref_errs[name] = rel(y, gold), rel(same, gold)
    check_errors(errs, ref_errs, dtype, record_property)


@pytest.mark.gpu
def test_scale_zero_rows_are_the_bare_base_exactly() -> None:
    """Slot 0 (scale 0) rows and out-of-range slots get y = x·Wᵀ bit for bit: the kernel skips
    them, reading neither the factors nor the workspace."""
    a, b, scales = _cuda_stacks(64, 96, [0, 8])
    a[0].fill_(float("nan"))  # never read
    x = randn(3, 1, 64, dtype=torch.bfloat16)
    w = randn(96, 64, dtype=torch.bfloat16)
    y = torch.nn.functional.linear(x, w)
    base = y.clone()
    lora_multi.kernel_add_(y, x, a, b, scales, torch.tensor([0, 1, 7], device="cuda"))
    assert torch.equal(y[0], base[0]) and torch.equal(y[2], base[2])
    assert not torch.equal(y[1], base[1])


@pytest.mark.gpu
@pytest.mark.no_memcheck
@pytest.mark.parametrize("parameter", [False, True], ids=["tensor", "parameter"])
def test_dispatch_runs_the_compiled_kernel_on_cuda(monkeypatch: pytest.MonkeyPatch, parameter: bool) -> None:
    """On CUDA tensors gpu_kernels.lora_linear_multi launches csrc/lora_multi.cu's kernels (seen
    by the profiler), not the plain-torch reference, also when the weight is a module's parameter
    (requires grad) and no gradient is recorded: how a served model calls it."""
    gpu_kernels.require_compiled()

    def no_reference(*args: object) -> torch.Tensor:
        raise AssertionError("the reference ran on CUDA tensors")

    monkeypatch.setattr(gpu_kernels.reference, "lora_linear_multi", no_reference)
    a, b, scales = _cuda_stacks(IN, OUT, RANKS)
    x = randn(4, 1, IN, dtype=torch.bfloat16)
    w = randn(OUT, IN, dtype=torch.bfloat16)
    if parameter:
        w = torch.nn.Parameter(w)
    idx = torch.tensor([1, 2, 0, 3], device="cuda")
    with (
        torch.inference_mode(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof,
    ):
        y = gpu_kernels.lora_linear_multi(x, w, None, a, b, scales, idx)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert any("shrink_kernel" in n for n in names) and any("expand_kernel" in n for n in names), names
    expected = ref.lora_linear_multi(x.float(), w.float(), None, a, b, scales, idx)
    assert rel(y, expected) < 2e-2


@pytest.mark.gpu
@pytest.mark.no_memcheck
def test_kernel_replays_in_a_cuda_graph() -> None:
    """The op inside a captured graph follows new inputs and new slots written into its static
    buffers (no host sync, no allocation at replay)."""
    a, b, scales = _cuda_stacks(IN, OUT, RANKS)
    w = randn(OUT, IN, dtype=torch.bfloat16)
    x = randn(4, 1, IN, dtype=torch.bfloat16)
    idx = torch.tensor([1, 2, 0, 3], device="cuda")
    with torch.inference_mode():
        gpu_kernels.lora_linear_multi(x, w, None, a, b, scales, idx)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = gpu_kernels.lora_linear_multi(x, w, None, a, b, scales, idx)
        for slots in ([3, 3, 1, 0], [2, 1, 2, 1]):
            x.copy_(randn(4, 1, IN, dtype=torch.bfloat16))
            idx.copy_(torch.tensor(slots))
            graph.replay()
            expected = ref.lora_linear_multi(x.float(), w.float(), None, a, b, scales, idx)
            assert rel(y, expected) < 2e-2
