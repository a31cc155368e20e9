"""The compiled dequantization of a tile of rows (csrc/quant.cu) for the NF4 and int8 formats.

One launch writes the tile in bf16 from the packed tensors, bit for bit what the format's torch
`dequant_rows(...).to(bfloat16)` gives (the same fp32 products, rounded once), without its fp32
temporaries. The tiled GEMM (gpu_kernels.quant.frozen) asks for it through
`FrozenWeight.tile_into`. A tile is a few microseconds of GPU time, so the host's side is kept to
pointer arithmetic and one ctypes call (no tensor slices, no stream object): a captured step does
not see it, but an eager one (warm-up, an op bench, a plan the captured step does not take) calls
it thousands of times, and at ~45 us a call (torch slices and torch.cuda.current_stream) the GPU
waited for the host (measured on an H100: one tile call 44-54 us of host time before, 12-14 us
after; an 8B q projection's forward + input gradient 1.24 -> 0.70 ms eager).
"""

from __future__ import annotations

import ctypes

import torch

from gpu_kernels import _lib

# Weights a thread dequantizes: one 4-byte (NF4) or 8-byte (int8) word.
WEIGHTS_PER_THREAD = 8

_handle: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    global _handle
    if _handle is None:
        _handle = _lib.load()
    return _handle


def takes(n_in: int, block: int, *tensors: torch.Tensor) -> bool:
    """Whether the kernels take this weight: 8 weights a thread within one block, contiguous
    packed rows on one CUDA device (checked once per weight; the backend per call)."""
    return (
        n_in % WEIGHTS_PER_THREAD == 0
        and block % WEIGHTS_PER_THREAD == 0
        and all(t.is_cuda and t.is_contiguous() for t in tensors)
        and len({t.device for t in tensors}) == 1
    )


def nf4_into(
    out: torch.Tensor,  # (rows, in) bf16, contiguous: rows start:stop of W
    start: int,
    packed: torch.Tensor,  # (out, in / 2) uint8, the whole weight's
    absmax: torch.Tensor | None,  # (out, in / block) fp32, or None (double quantization)
    dq: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # (codes, scale, mean), whole weight's
    block: int,
) -> torch.Tensor:
    rows, n_in = out.shape
    per_row = n_in // block
    codes, scale, mean = dq if dq is not None else (None, None, None)
    rc = _library().loraq_nf4_dequant(
        packed.data_ptr() + start * (n_in // 2),
        absmax.data_ptr() + start * per_row * 4 if absmax is not None else None,
        _lib.ptr(codes),
        _lib.ptr(scale),
        _lib.ptr(mean),
        start * per_row, rows, n_in, block, out.data_ptr(),
        torch._C._cuda_getCurrentRawStream(out.device.index),
    )  # fmt: skip
    if rc:
        _lib.check(rc, "loraq_nf4_dequant")
    return out


def int8_into(out: torch.Tensor, start: int, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Rows start:start + rows of an int8 weight (codes (out, in), scale (out,) fp32) into `out`
    (rows, in) bf16."""
    rows, n_in = out.shape
    rc = _library().loraq_int8_dequant(
        codes.data_ptr() + start * n_in,
        scale.data_ptr() + start * 4,
        rows, n_in, out.data_ptr(),
        torch._C._cuda_getCurrentRawStream(out.device.index),
    )  # fmt: skip
    if rc:
        _lib.check(rc, "loraq_int8_dequant")
    return out
