"""The gated MLP with LoRA on gate, up and down as one op (gpu_kernels.ops.lora_mlp,
csrc/lora_mlp.cu), against the composed reference ops in float64, and the dispatch that picks it.

The op runs on CUDA only (bf16, rank 16); off those conditions gpu_kernels.lora_gated_mlp composes
the LoRA ops and swiglu_packed, which the CPU test at the top checks against the plain formula.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch

import gpu_kernels
from gpu_kernels import reference as ref
from gpu_kernels.ops import lora_mlp
from gpu_kernels.ops.norm_act_reference import Activation
from gpu_kernels.quant import FrozenWeight
from tests.gpu_kernels.oracle import Recorder, assert_matches_reference, saved_storages, shapes

ACTIVATIONS = ["silu", "gelu_tanh"]


def _mlp_reference(activation: Activation, scales: tuple[float, float, float]):  # type: ignore[no-untyped-def]
    def run(x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d):  # type: ignore[no-untyped-def]
        gu = ref.lora_linear_grouped(x, w_gu, None, [(a_g, b_g, scales[0]), (a_u, b_u, scales[1])])
        return ref.lora_linear_grouped(ref.swiglu_packed(gu, activation), w_d, None, [(a_d, b_d, scales[2])])

    return run


def _inputs(
    m: int,
    k: int,
    f: int,
    device: str,
    dtype: torch.dtype,
    rank: int = 16,
    ranks: tuple[int, int, int] | None = None,
) -> list[torch.Tensor]:
    """x, W_gu, W_d (dtype; x requires grad) and the six factors, fp32 (fp64 with an fp64 dtype),
    all requiring grad; B not zero, so every gradient path carries signal."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=wide) * scale

    x = (rnd(m, k, scale=1.0)).to(dtype).requires_grad_()
    w_gu = rnd(2 * f, k, scale=k**-0.5).to(dtype)
    w_d = rnd(k, f, scale=f**-0.5).to(dtype)
    r_g, r_u, r_d = ranks or (rank, rank, rank)
    factors = [
        rnd(r_g, k, scale=k**-0.5), rnd(f, r_g, scale=0.05),  # A_g, B_g
        rnd(r_u, k, scale=k**-0.5), rnd(f, r_u, scale=0.05),  # A_u, B_u
        rnd(r_d, f, scale=f**-0.5), rnd(k, r_d, scale=0.05),  # A_d, B_d
    ]  # fmt: skip
    return [x, w_gu, w_d, *[t.requires_grad_() for t in factors]]


def test_the_memory_plan_knows_the_fused_rank() -> None:
    """The plan (pure Python, no torch) mirrors the rank the fused op serves."""
    from worker.engine.memory_plan import FUSED_MLP_RANK

    assert FUSED_MLP_RANK == lora_mlp.RANK


def test_composed_path_equals_the_formula_on_cpu() -> None:
    """Off the fused op's conditions (here: CPU, fp64) the dispatch composes the LoRA ops."""
    torch.manual_seed(0)
    x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d = _inputs(5, 24, 16, "cpu", torch.float64)
    s = (2.0, 0.5, 1.5)
    got = gpu_kernels.lora_gated_mlp(
        x,
        gpu_kernels.LoRAOp(w_gu, None, [(a_g, b_g, s[0]), (a_u, b_u, s[1])]),
        gpu_kernels.LoRAOp(w_d, None, [(a_d, b_d, s[2])]),
        "gelu_tanh",
        training=True,
    )
    g = x @ (w_gu[:16] + s[0] * b_g @ a_g).t()
    u = x @ (w_gu[16:] + s[1] * b_u @ a_u).t()
    h = torch.nn.functional.gelu(g, approximate="tanh") * u
    torch.testing.assert_close(got, h @ (w_d + s[2] * b_d @ a_d).t(), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize(
    ("m", "k", "f"),
    # one row; a row tail and a column tail (F not a multiple of the block's 256 columns); a
    # multi-group grid; then Gemma-3-1B's and Llama-3.2-1B's MLPs at a packed step's 8,192 rows
    shapes([(1, 64, 96), (37, 256, 1000), (300, 128, 2056)], [(8192, 1152, 6912), (8192, 2048, 8192)]),
)
def test_fused_mlp_matches_reference(
    m: int, k: int, f: int, activation: Activation, record_property: Recorder
) -> None:
    _check_fused(m, k, f, activation, (16, 16, 16), record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [(8, 8, 8), (4, 12, 1)])
def test_fused_mlp_pads_ranks_under_16(ranks: tuple[int, int, int], record_property: Recorder) -> None:
    """Ranks under 16 run the same kernel with zero rows: same results, gradients of their own shape."""
    _check_fused(300, 128, 2056, "gelu_tanh", ranks, record_property)


def _check_fused(
    m: int, k: int, f: int, activation: Activation, ranks: tuple[int, int, int], record_property: Recorder
) -> None:
    torch.manual_seed(m + f + sum(ranks))
    inputs = _inputs(m, k, f, "cuda", torch.bfloat16, ranks=ranks)
    scales = (2.0, 0.5, 1.5)

    def ours(x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d):  # type: ignore[no-untyped-def]
        gate_up = [(a_g, b_g, scales[0]), (a_u, b_u, scales[1])]
        assert lora_mlp.fusable(x, w_gu, w_d, gate_up, [(a_d, b_d, scales[2])])
        return lora_mlp.lora_gated_mlp(
            x, w_gu, w_d, gate_up, [(a_d, b_d, scales[2])], activation, (None, None)
        )

    assert_matches_reference(
        ours, _mlp_reference(activation, scales), inputs, torch.randn(m, k, device="cuda"),
        ["y", "dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"], torch.bfloat16, record_property,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 8])
def test_fused_mlp_with_one_adapter_over_gate_and_up_matches_reference(
    rank: int, record_property: Recorder
) -> None:
    """Phi-3's gate_up_proj: one adapter A (r, K), B (2F, r) over the packed [gate | up]."""
    m, k, f = 300, 128, 2056
    torch.manual_seed(rank)
    x, w_gu, w_d, a_g, b_g, _, b_u, a_d, b_d = _inputs(m, k, f, "cuda", torch.bfloat16, rank=rank)
    b_gu = torch.cat([b_g, b_u]).detach().requires_grad_()  # (2F, r)
    scales = (2.0, 1.5)

    def ours(x, w_gu, w_d, a, b, a_d, b_d):  # type: ignore[no-untyped-def]
        gate_up, down = [(a, b, scales[0])], [(a_d, b_d, scales[1])]
        assert lora_mlp.fusable(x, w_gu, w_d, gate_up, down)
        return lora_mlp.lora_gated_mlp(x, w_gu, w_d, gate_up, down, "silu", (None, None))

    def reference(x, w_gu, w_d, a, b, a_d, b_d):  # type: ignore[no-untyped-def]
        gu = ref.lora_linear_grouped(x, w_gu, None, [(a, b, scales[0])])
        return ref.lora_linear_grouped(ref.swiglu_packed(gu, "silu"), w_d, None, [(a_d, b_d, scales[1])])

    assert_matches_reference(
        ours, reference, [x, w_gu, w_d, a_g, b_gu, a_d, b_d], torch.randn(m, k, device="cuda"),
        ["y", "dx", "dA_gu", "dB_gu", "dA_d", "dB_d"], torch.bfloat16, record_property,
    )  # fmt: skip


def _mlp(inputs: list[torch.Tensor], dropout: float = 0.0) -> torch.Tensor:
    x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d = inputs
    return gpu_kernels.lora_gated_mlp(
        x,
        gpu_kernels.LoRAOp(w_gu, None, [(a_g, b_g, 2.0), (a_u, b_u, 2.0)], dropout),
        gpu_kernels.LoRAOp(w_d, None, [(a_d, b_d, 2.0)], dropout),
        "silu",
        training=True,
    )


@pytest.mark.gpu
def test_dispatch_fuses_only_what_the_kernel_serves() -> None:
    fused = "LoRAGatedMLPFunctionBackward"
    assert type(_mlp(_inputs(64, 128, 256, "cuda", torch.bfloat16)).grad_fn).__name__ == fused
    assert type(_mlp(_inputs(64, 128, 256, "cuda", torch.bfloat16, rank=8)).grad_fn).__name__ == fused
    # rank 32, dropout, fp32: the composed ops (still the compiled LoRA and activation kernels)
    assert type(_mlp(_inputs(64, 128, 256, "cuda", torch.bfloat16, rank=32)).grad_fn).__name__ != fused
    assert type(_mlp(_inputs(64, 128, 256, "cuda", torch.bfloat16), dropout=0.1).grad_fn).__name__ != fused
    assert type(_mlp(_inputs(64, 128, 256, "cuda", torch.float32)).grad_fn).__name__ != fused


@pytest.mark.gpu
def test_fused_mlp_saves_no_activation_of_width_f() -> None:
    """The point of the op's memory: the (M, F) activation h is not kept for the backward."""

    m, f = 512, 1024
    x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d = _inputs(m, 256, f, "cuda", torch.bfloat16)
    gate_up = gpu_kernels.LoRAOp(w_gu, None, [(a_g, b_g, 2.0), (a_u, b_u, 2.0)])
    down = gpu_kernels.LoRAOp(w_d, None, [(a_d, b_d, 2.0)])

    def saved_bytes(fused: bool) -> int:
        with saved_storages() as seen:
            if fused:
                y = gpu_kernels.lora_gated_mlp(x, gate_up, down, "silu", training=True)
                assert type(y.grad_fn).__name__ == "LoRAGatedMLPFunctionBackward"
            else:  # what the dispatch composes where the fused op does not serve
                down(gpu_kernels.swiglu_packed(gate_up(x, True)), True)
        return sum(seen.values())

    composed, fused = saved_bytes(False), saved_bytes(True)
    assert composed - fused >= m * f * 2, (composed, fused)


@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 8])
def test_adapter_casts_operands_give_the_same_step(rank: int) -> None:
    """Inside a step the op takes its operands from an AdapterCasts (ranks packed, padded here)."""
    torch.manual_seed(rank)
    x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d = _inputs(96, 128, 512, "cuda", torch.bfloat16, rank=rank)
    gate_up, down = [(a_g, b_g, 2.0), (a_u, b_u, 0.5)], [(a_d, b_d, 1.5)]
    casts = gpu_kernels.adapter_casts([gate_up, down], torch.bfloat16)
    outs = []
    for use_casts in (False, True):
        with casts.in_step():
            ops = (casts.operands(0), casts.operands(1)) if use_casts else (None, None)
            y = lora_mlp.lora_gated_mlp(x, w_gu, w_d, gate_up, down, "silu", ops)
        outs.append(y.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


MLP = Callable[..., torch.Tensor]  # (x, W_gu, W_d, A_g, B_g, A_u, B_u, A_d, B_d) -> y
Base = torch.Tensor | FrozenWeight


def _run_keeping(
    mlp: MLP,
    x0: torch.Tensor,
    w_gu: Base,
    w_d: Base,
    factors: list[torch.Tensor],
    dy: torch.Tensor,
) -> tuple[list[torch.Tensor | None], bool, int]:
    """mlp on x0 and the factors as fresh leaves, then backward dy: [y, dx, the factors' gradients],
    whether autograd kept x's storage for the backward, and the largest storage it kept (bytes)."""
    x = x0.clone().requires_grad_()
    leaves = [t.detach().clone().requires_grad_() for t in factors]
    with saved_storages() as kept:
        y = mlp(x, w_gu, w_d, *leaves)
    y.backward(dy)
    outputs = [y.detach(), x.grad, *(t.grad for t in leaves)]
    return outputs, x.untyped_storage().data_ptr() in kept, max(kept.values())


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_fused_mlp_on_a_norm_output_keeps_the_norm_input_not_the_output(
    offset: float, record_property: Recorder
) -> None:
    """Given x's NormSource (x = RMSNorm(h), what the fused decoder passes), the op keeps h and
    rstd instead of x: x's storage is not among the saved tensors, the output equals the op's
    without the source, and every gradient is within bf16's bound of the fp64 reference and no
    sloppier than the op's without the source (oracle.check_errors). Not bit for bit: dA_g, dA_u
    round U ⊙ rstd where x was rounded, and the kernel's fp32 atomics (U, G, dA_d) add in no fixed
    order, so two runs of the same op differ in the last bits (seen on an H100: dB_g)."""
    from gpu_kernels.ops.norm_source import NormSource
    from tests.gpu_kernels.oracle import check_errors, rel

    torch.manual_seed(7)
    m, k, f = 300, 128, 1000
    _, w_gu, w_d, *factors = _inputs(m, k, f, "cuda", torch.bfloat16)
    h = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    norm_w = (0.3 * torch.randn(k, device="cuda")).to(torch.bfloat16)
    rstd = torch.rsqrt(h.float().pow(2).mean(-1) + 1e-6)  # (M,)
    x0 = ((offset + norm_w.float()) * (h.float() * rstd[:, None])).to(torch.bfloat16)
    dy = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    scales = (2.0, 0.5, 1.5)

    def fused(source: NormSource | None) -> MLP:
        def run(x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d):  # type: ignore[no-untyped-def]
            return lora_mlp.lora_gated_mlp(
                x, w_gu, w_d, [(a_g, b_g, scales[0]), (a_u, b_u, scales[1])], [(a_d, b_d, scales[2])],
                "gelu_tanh", (None, None), source,
            )  # fmt: skip

        return run

    plain, plain_kept_x, _ = _run_keeping(fused(None), x0, w_gu, w_d, factors, dy)
    ours, ours_kept_x, _ = _run_keeping(
        fused(NormSource(h, rstd, norm_w, offset)), x0, w_gu, w_d, factors, dy
    )
    gold, _, _ = _run_keeping(
        _mlp_reference("gelu_tanh", scales), x0.double(), w_gu.double(), w_d.double(),
        [t.double() for t in factors], dy.double(),
    )  # fmt: skip
    assert plain_kept_x and not ours_kept_x
    assert ours[0] is not None and plain[0] is not None and torch.equal(ours[0], plain[0])
    names = ["y", "dx", "dA_g", "dB_g", "dA_u", "dB_u", "dA_d", "dB_d"]
    errs, plain_errs = {}, {}
    for name, got, without, want in zip(names, ours, plain, gold, strict=True):
        assert got is not None and without is not None and want is not None
        errs[name], plain_errs[name] = rel(got, want), rel(without, want)
    check_errors(errs, plain_errs, torch.bfloat16, record_property)


def _glu_bwd_lora_formula(
    dh: torch.Tensor, gu: torch.Tensor, u_d: torch.Tensor, d_gu: torch.Tensor, xa: torch.Tensor, act: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What csrc/lora_mlp.cu computes (its file comment), in torch: dgu, U, G, dA_d."""
    f = dh.shape[1]
    g = gu[:, :f].detach().requires_grad_()
    fn = torch.nn.functional.silu if act == 0 else partial(torch.nn.functional.gelu, approximate="tanh")
    with torch.enable_grad():
        a = fn(g)
        (da,) = torch.autograd.grad(a.sum(), g)
    a, u = a.detach(), gu[:, f:]
    dgu = torch.cat([dh * u * da, dh * a], dim=1)  # (M, 2F)
    g_acc = torch.cat([dgu[:, :f].t() @ xa[:, :16], dgu[:, f:].t() @ xa[:, 16:]])  # (2F, 16): rank 16
    return dgu, dgu @ d_gu.t(), g_acc, u_d.t() @ (a * u)


def _compact(
    w_gu: torch.Tensor, w_d: torch.Tensor, base: str
) -> tuple[Base, Base, torch.Tensor, torch.Tensor]:
    """The op's base weights in `base`'s format (dense: as given; nf4, int8: quantized, gate and
    up as one StackedWeight as a quantized layer stacks them), and what they hold, dense."""
    from gpu_kernels.quant import StackedWeight, quantize_int8, quantize_nf4

    if base == "dense":
        return w_gu, w_d, w_gu, w_d
    make = quantize_nf4 if base == "nf4" else quantize_int8
    f = w_d.shape[1]
    gu = StackedWeight([make(w_gu[:f], dtype=w_gu.dtype), make(w_gu[f:], dtype=w_gu.dtype)])
    d = make(w_d, dtype=w_d.dtype)
    return gu, d, gu.dequantize(), d.dequantize()


@pytest.mark.parametrize("base", ["dense", "nf4", "int8"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_ops_torch_part_keeps_a_norm_source_on_the_cpu(
    activation: Activation, base: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused op's torch part (operands, GEMMs, dA_gu from x's NormSource) in fp64 on the CPU,
    its two kernels stood in by their formulas: for x = RMSNorm(h) given with its source, output
    and every gradient equal the composed reference ops on x (1e-10), and x is not kept. On a
    compact base (a QLoRA step's) the base GEMMs run over the weights' dequantized tiles, 16 rows
    a tile here so that each GEMM spans many, against the reference on the dequantized weights;
    no dense copy of a weight is kept."""
    from gpu_kernels.ops.norm_source import NormSource
    from gpu_kernels.quant import frozen

    monkeypatch.setattr(lora_mlp, "_glu_bwd_lora", _glu_bwd_lora_formula)

    def swiglu_fwd(g: torch.Tensor, _ldg: int, u: torch.Tensor, _ldu: int, act: int) -> torch.Tensor:
        return ref.swiglu(g, u, "silu" if act == 0 else "gelu_tanh")

    monkeypatch.setattr(lora_mlp, "_swiglu_fwd", swiglu_fwd)
    torch.manual_seed(3)
    m, k, f = 23, 128, 128  # NF4 blocks of 64 a row
    monkeypatch.setattr(frozen, "TILE_ELEMENTS", 16 * f)
    _, w_gu_dense, w_d_dense, *factors = _inputs(m, k, f, "cpu", torch.float64)
    w_gu, w_d, w_gu_held, w_d_held = _compact(w_gu_dense, w_d_dense, base)
    h = torch.randn(m, k, dtype=torch.float64)
    norm_w = 0.3 * torch.randn(k, dtype=torch.float64)
    rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)
    x0 = (1.0 + norm_w) * h * rstd[:, None]
    dy = torch.randn(m, k, dtype=torch.float64)
    scales = (2.0, 0.5, 1.5)

    def ours(x, w_gu, w_d, a_g, b_g, a_u, b_u, a_d, b_d):  # type: ignore[no-untyped-def]
        return lora_mlp.lora_gated_mlp(
            x, w_gu, w_d, [(a_g, b_g, scales[0]), (a_u, b_u, scales[1])], [(a_d, b_d, scales[2])],
            activation, (None, None), NormSource(h, rstd, norm_w, 1.0),
        )  # fmt: skip

    got, ours_kept_x, largest = _run_keeping(ours, x0, w_gu, w_d, factors, dy)
    reference = _mlp_reference(activation, scales)
    want, ref_kept_x, _ = _run_keeping(reference, x0, w_gu_held, w_d_held, factors, dy)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert ref_kept_x and not ours_kept_x
    if base != "dense":  # no dense copy of a weight (the smaller is W_d's) among what the op keeps
        assert largest < w_d_held.numel() * w_d_held.element_size()
