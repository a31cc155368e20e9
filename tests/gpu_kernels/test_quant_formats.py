"""Frozen-weight formats (gpu_kernels.quant) on the CPU, against independent references:

- GGML blocks: gguf-py's `gguf.quants.dequantize` (numpy), bit for bit, for every supported type;
- NF4: an independent numpy twin written from the QLoRA paper (its code table rebuilt from the
  normal quantiles with the standard library, nearest-code rounding, bitsandbytes' nibble order);
- int8: a numpy twin of row-wise absmax;
- the tiled matmul: forward and input gradient against dequantize-then-matmul in fp64, over
  several tiles and over a stack of mixed formats.
"""

from __future__ import annotations

import itertools
from statistics import NormalDist

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

import gpu_kernels
from gpu_kernels import quant
from gpu_kernels.quant import (
    GGML_TYPES,
    DenseWeight,
    FrozenWeight,
    GGMLWeight,
    StackedWeight,
    dequantize_blocks,
    quantize_int8,
    quantize_nf4,
)

# byte offsets of each type's fp16 fields (d, dmin or m): random bytes there could be inf/NaN
HALF_FIELDS = {
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q8_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(ggml_type: str, n: int, seed: int = 0) -> np.ndarray:
    """n blocks of random codes and scales (every bit pattern of the codes is a valid block)."""
    rng = np.random.default_rng(seed)
    _, size, _ = GGML_TYPES[ggml_type]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for offset in HALF_FIELDS[ggml_type]:
        raw[:, offset : offset + 2] = rng.uniform(-0.05, 0.05, (n, 1)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("ggml_type", sorted(GGML_TYPES))
def test_ggml_dequantization_equals_gguf_py_bit_for_bit(ggml_type: str) -> None:
    per_block, _, _ = GGML_TYPES[ggml_type]
    raw = random_blocks(ggml_type, 64)
    reference = quants.dequantize(raw.reshape(-1), GGMLQuantizationType[ggml_type]).reshape(64, per_block)
    ours = dequantize_blocks(torch.from_numpy(raw), ggml_type).numpy()
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_ggml_blocks_quantized_by_gguf_py_read_back(ggml_type: str) -> None:
    """Blocks as llama.cpp's quantizer writes them (gguf-py's port) of a real weight."""
    w = np.random.default_rng(1).normal(0, 0.02, (16, 128)).astype(np.float32)
    qtype = GGMLQuantizationType[ggml_type]
    raw = quants.quantize(w, qtype)  # (16, row bytes)
    weight = GGMLWeight((16, 128), torch.float64, torch.from_numpy(raw), ggml_type)
    np.testing.assert_array_equal(weight.dequantize(torch.float32).numpy(), quants.dequantize(raw, qtype))
    assert np.abs(weight.dequantize().numpy() - w).max() < 0.2 * np.abs(w).max()


def test_ggml_weight_refuses_blocks_of_another_shape() -> None:
    with pytest.raises(ValueError, match="do not hold"):
        GGMLWeight((4, 64), torch.float32, torch.zeros(4, 35, dtype=torch.uint8), "Q8_0")
    with pytest.raises(ValueError, match="not supported"):
        GGMLWeight((4, 64), torch.float32, torch.zeros(4, 36, dtype=torch.uint8), "IQ2_XS")


# ------------------------------------------------------------------ NF4


def nf4_table_from_the_paper() -> np.ndarray:
    """QLoRA's NF4 values, rebuilt: 8 positive quantiles of N(0, 1) over [δ, 1/2] and 7 negative
    ones (so that 0 is exact), δ = ½(32/31 + 30/31)·... as bitsandbytes' `create_normal_map`
    (offset 0.9677083), each side normalised so its largest magnitude is 1."""
    offset = 0.9677083
    ppf = NormalDist().inv_cdf
    positive = [ppf(p) for p in np.linspace(offset, 0.5, 9)[:-1]]
    negative = [-ppf(p) for p in np.linspace(offset, 0.5, 8)[:-1]]
    values = np.array(sorted([*positive, 0.0, *negative]))
    return values / np.abs(values).max()


def nf4_numpy(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed codes, absmax, dequantized) of w, written from the paper without torch."""
    code = nf4_table_from_the_paper().astype(np.float32)
    out, n_in = w.shape
    blocks = w.reshape(out, n_in // block, block).astype(np.float32)
    absmax = np.abs(blocks).max(axis=-1)
    scaled = blocks / absmax[..., None]
    q = np.abs(scaled[..., None] - code).argmin(axis=-1).astype(np.uint8).reshape(out, n_in)
    packed = (q[:, 0::2] << 4) | q[:, 1::2]
    dequant = (code[q].reshape(out, n_in // block, block) * absmax[..., None]).reshape(out, n_in)
    return packed, absmax, dequant


def test_nf4_code_table_is_the_papers() -> None:
    np.testing.assert_allclose(np.array(quant.NF4_CODE), nf4_table_from_the_paper(), atol=2e-7)


def test_nf4_quantization_equals_an_independent_numpy_twin() -> None:
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) * 0.02
    nf4 = quantize_nf4(w, dtype=torch.float64)
    packed, absmax, dequant = nf4_numpy(w.numpy(), 64)
    np.testing.assert_array_equal(nf4.packed.numpy(), packed)
    assert nf4.absmax is not None
    np.testing.assert_array_equal(nf4.absmax.numpy(), absmax)
    # the twin's table is rebuilt from the quantiles: it agrees with bitsandbytes' to ~2e-7
    np.testing.assert_allclose(nf4.dequantize(torch.float32).numpy(), dequant, rtol=1e-6, atol=0)
    # the error of each weight is at most half the widest gap of the code, times its block's absmax
    widest = float(np.diff(np.array(quant.NF4_CODE)).max()) / 2
    bound = np.repeat(absmax, 64, axis=1) * widest
    assert (np.abs(nf4.dequantize().numpy() - w.numpy()) <= bound + 1e-9).all()
    assert nf4.nbytes == 32 * 128 + 32 * 4 * 4  # 4 bits a weight + an fp32 absmax a block


def test_nf4_double_quant_keeps_the_absmax_within_half_a_step() -> None:
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    single, double = quantize_nf4(w), quantize_nf4(w, double_quant=True)
    assert single.absmax is not None and double.dq_scale is not None
    np.testing.assert_array_equal(double.packed.numpy(), single.packed.numpy())
    restored = double.block_absmax(0, 64)
    step = double.dq_scale.repeat_interleave(256)[: restored.numel()].view_as(restored)
    assert ((restored - single.absmax).abs() <= step / 2 + 1e-6).all()
    assert double.nbytes < single.nbytes


def test_nf4_needs_whole_blocks_per_row() -> None:
    with pytest.raises(ValueError, match="divisible by 64"):
        quantize_nf4(torch.zeros(4, 96))


# ------------------------------------------------------------------ int8


def test_int8_equals_a_numpy_twin() -> None:
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(4))
    int8 = quantize_int8(w)
    scale = np.abs(w.numpy()).max(axis=1) / 127
    codes = np.clip(np.round(w.numpy() / scale[:, None]), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(int8.codes.numpy(), codes)
    np.testing.assert_array_equal(
        int8.dequantize(torch.float32).numpy(), codes.astype(np.float32) * scale[:, None]
    )


# ------------------------------------------------------------------ the tiled matmul


def weights_of_every_format() -> dict[str, FrozenWeight]:
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(48, 256, generator=g, dtype=torch.float64) * 0.05
    found: dict[str, FrozenWeight] = {
        "nf4": quantize_nf4(dense, dtype=torch.float64),
        "nf4-dq": quantize_nf4(dense, double_quant=True, dtype=torch.float64),
        "int8": quantize_int8(dense, dtype=torch.float64),
    }
    for ggml_type, (per_block, _, _) in GGML_TYPES.items():
        raw = random_blocks(ggml_type, 48 * 256 // per_block, seed=6).reshape(48, -1)
        found[ggml_type] = GGMLWeight((48, 256), torch.float64, torch.from_numpy(raw), ggml_type)
    found["stacked"] = StackedWeight([found["nf4"], found["Q6_K"], DenseWeight(dense[:8])])
    return found


@pytest.mark.parametrize("name", list(weights_of_every_format()))
def test_tiled_matmul_and_input_grad_equal_dequantize_then_matmul(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant.frozen, "TILE_ELEMENTS", 256 * 5)  # 5 rows a tile: several tiles, one short
    weight = weights_of_every_format()[name]
    assert len(list(weight.tiles())) > 1
    dense = weight.dequantize(torch.float64)
    x = torch.randn(3, 7, 256, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = weight.matmul(x), x_ref @ dense.t()
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)


def test_tiles_start_on_aligned_rows_and_share_one_buffer() -> None:
    """Tiles of a wide layer start on TILE_ROW_ALIGN-row boundaries (cuBLAS's fast paths read and
    write column blocks from there: a 14,336-wide layer's tiles were 585 rows) and cover every row;
    each_tile writes every tile into one buffer in turn, equal to the dequantized rows."""
    weight = quantize_int8(torch.randn(1000, 14336, dtype=torch.float64))
    tiles = list(weight.tiles())
    assert tiles[0][0] == 0 and tiles[-1][1] == 1000
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(tiles))  # contiguous cover
    assert all(a % quant.frozen.TILE_ROW_ALIGN == 0 for a, _ in tiles) and len(tiles) > 1
    dense = weight.dequantize(torch.float64)
    pointers = set()
    for start, stop, tile in weight.each_tile(torch.float64):
        assert torch.equal(tile, dense[start:stop])
        pointers.add(tile.data_ptr())
    assert len(pointers) == 1  # one buffer, every tile written at its start


def test_lora_op_on_a_frozen_weight_equals_the_dense_lora_op() -> None:
    g = torch.Generator().manual_seed(7)
    weight = quantize_nf4(torch.randn(40, 128, generator=g), dtype=torch.float64)
    bias = torch.randn(40, generator=g, dtype=torch.float64)
    a = torch.randn(4, 128, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 5, 128, generator=g, dtype=torch.float64)
    y = gpu_kernels.lora_linear(x, weight, bias, a, b, 0.5)
    ref = gpu_kernels.reference.lora_linear(x, weight.dequantize(), bias, a, b, 0.5)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    grouped = gpu_kernels.lora_linear_grouped(x, StackedWeight([weight, weight]), None, [(a, b, 0.5)] * 2)
    torch.testing.assert_close(grouped, torch.cat([ref - bias] * 2, dim=-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_source", [False, True], ids=["plain", "norm-source"])
def test_the_compiled_lora_ops_torch_part_over_a_frozen_weight(
    with_source: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a QLoRA step's LoRA ops run on the GPU (gpu_kernels.ops.lora: the LoRA term first,
    each tile's base GEMM adding into its columns; the input gradient tile by tile), in fp64 on
    the CPU: q/k/v over an NF4 StackedWeight, 16 rows a tile, against the reference op on the
    dequantized weight (1e-12). Given x's NormSource (x = RMSNorm(h)), x is not kept; no dense
    copy of the weight is kept either way."""
    from gpu_kernels.ops import lora
    from gpu_kernels.ops.norm_source import NormSource
    from gpu_kernels.quant import frozen
    from tests.gpu_kernels.oracle import saved_storages

    monkeypatch.setattr(frozen, "TILE_ELEMENTS", 16 * 128)
    g = torch.Generator().manual_seed(11)
    weight = StackedWeight(
        [quantize_nf4(torch.randn(n, 128, generator=g) * 0.1, dtype=torch.float64) for n in (128, 64, 64)]
    )
    dense = weight.dequantize()

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * 0.1

    adapters = [(rnd(r, 128), rnd(n, r), s) for r, n, s in ((4, 128, 2.0), (8, 64, 0.5), (4, 64, 1.0))]
    h = torch.randn(2, 9, 128, generator=g, dtype=torch.float64)
    norm_w = 0.3 * torch.randn(128, generator=g, dtype=torch.float64)
    rstd = torch.rsqrt(h.pow(2).mean(-1) + 1e-6)  # (2, 9)
    x0 = (1.0 + norm_w) * h * rstd[..., None]
    dy = torch.randn(2, 9, 256, generator=g, dtype=torch.float64)
    source = NormSource(h.reshape(-1, 128), rstd.reshape(-1), norm_w, 1.0) if with_source else None

    def ours(x: torch.Tensor, factors: list[tuple[torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
        return lora.lora_linear_grouped(x, weight, None, factors, 0.0, True, None, source)

    def reference(x: torch.Tensor, factors: list[tuple[torch.Tensor, torch.Tensor, float]]) -> torch.Tensor:
        return gpu_kernels.reference.lora_linear_grouped(x, dense, None, factors)

    results = []
    for op in (ours, reference):
        x = x0.clone().requires_grad_()
        leaves = [(a.clone().requires_grad_(), b.clone().requires_grad_(), s) for a, b, s in adapters]
        with saved_storages() as kept:
            y = op(x, leaves)
        y.backward(dy)
        results.append(([y, x.grad, *(t.grad for a, b, _ in leaves for t in (a, b))], kept, x))
    (got_all, kept, x), (want, _, _) = results
    for got, expect in zip(got_all, want, strict=True):
        torch.testing.assert_close(got, expect, rtol=1e-12, atol=1e-12)
    assert (x.untyped_storage().data_ptr() in kept) != with_source
    assert max(kept.values()) < 64 * 128 * 8  # the smallest part's dense bytes


def test_a_packed_weight_is_never_taken_for_a_dense_one() -> None:
    """dispatch used to compare x.dtype with weight.dtype and fall back to F.linear: an int8 or
    uint8 tensor passed as a weight is an error now, not a silent wrong answer."""
    x = torch.randn(2, 64)
    a, b = torch.zeros(2, 64), torch.zeros(8, 2)
    with pytest.raises(TypeError, match="FrozenWeight"):
        gpu_kernels.lora_linear(x, torch.zeros(8, 64, dtype=torch.int8), None, a, b, 1.0)


def test_moving_keeps_the_packed_dtypes_and_sets_the_compute_dtype() -> None:
    nf4 = quantize_nf4(torch.randn(8, 64), double_quant=True)
    moved = nf4.to("cpu", torch.bfloat16)
    assert moved.dtype == torch.bfloat16
    assert {k: t.dtype for k, t in moved.tensors().items()} == {k: t.dtype for k, t in nf4.tensors().items()}
    torch.testing.assert_close(moved.dequantize(torch.float32), nf4.dequantize(torch.float32), rtol=0, atol=0)
