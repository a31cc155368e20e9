"""The compiled dequantization of a tile of rows (csrc/quant.cu) for the NF4 and int8 formats.

One launch writes the tile in bf16 from the packed tensors, bit for bit what the format's torch
`dequant_rows(...).to(bfloat16)` gives (the same fp32 products, rounded once), without its fp32
temporaries. The tiled GEMM (gpu_kernels.quant.frozen) asks for it through `FrozenWeight.tile`.
"""

from __future__ import annotations

import torch

from gpu_kernels import _lib

# Rows a thread reads as one 4-byte (NF4) or 8-byte (int8) word: 8 weights.
WEIGHTS_PER_THREAD = 8


def nf4_tile(
    packed: torch.Tensor,  # (rows, in / 2) uint8, the tile's rows
    absmax: torch.Tensor | None,  # (rows, in / block) fp32, or None (double quantization)
    dq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # the whole weight's (codes, scale, mean)
    first_block: int,  # the tile's first block in the whole weight (double quantization's groups)
    n_in: int,
    block: int,
) -> torch.Tensor:
    """(rows, n_in) bf16: the NF4 tile dequantized in one launch."""
    rows = packed.shape[0]
    out = torch.empty((rows, n_in), dtype=torch.bfloat16, device=packed.device)
    codes, scale, mean = dq if dq is not None else (None, None, None)
    rc = _lib.load().loraq_nf4_dequant(
        packed.data_ptr(),
        absmax.data_ptr() if absmax is not None else None,
        codes.data_ptr() if codes is not None else None,
        scale.data_ptr() if scale is not None else None,
        mean.data_ptr() if mean is not None else None,
        first_block, rows, n_in, block, out.data_ptr(), _lib.stream(packed.device),
    )  # fmt: skip
    _lib.check(rc, "loraq_nf4_dequant")
    return out


def int8_tile(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(rows, in) bf16 from the tile's int8 codes (rows, in) and row scales (rows,) fp32."""
    rows, n_in = codes.shape
    out = torch.empty((rows, n_in), dtype=torch.bfloat16, device=codes.device)
    rc = _lib.load().loraq_int8_dequant(
        codes.data_ptr(), scale.data_ptr(), rows, n_in, out.data_ptr(), _lib.stream(codes.device)
    )
    _lib.check(rc, "loraq_int8_dequant")
    return out


def fits(n_in: int, *tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tiles: 8 weights a thread, contiguous packed rows."""
    return n_in % WEIGHTS_PER_THREAD == 0 and all(t.is_contiguous() for t in tensors)
