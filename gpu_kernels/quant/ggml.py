"""llama.cpp's GGML block formats as frozen weights: the blocks of a GGUF file used as they are.

A row of W (out, in) is in / block_size consecutive blocks of `type_size` bytes; `GGMLWeight`
holds them as one (out, in / block_size · type_size) uint8 tensor, a zero-copy view of the mmap'd
file on the CPU. Each dequantizer below does, in fp32 and in the same order of operations,
what gguf-py's `gguf.quants` does (its numpy twin is the test's reference), so values agree bit
for bit. Layouts (d, dmin, m: fp16; qs, qh: packed codes; sizes in bytes):

    Q4_0  32 weights, 18 B: d, qs[16]            w = d · (q − 8)
    Q4_1  32 weights, 20 B: d, m, qs[16]         w = d · q + m
    Q5_0  32 weights, 22 B: d, qh[4], qs[16]     w = d · (q − 16), q = low 4 bits | high bit << 4
    Q5_1  32 weights, 24 B: d, m, qh[4], qs[16]  w = d · q + m
    Q8_0  32 weights, 34 B: d, q[32] (int8)      w = d · q
    Q4_K 256 weights, 144 B: d, dmin, 12 B of 6-bit (scale, min) for 8 sub-blocks of 32, qs[128]
                             w = d · sc_j · q − dmin · m_j
    Q5_K 256 weights, 176 B: as Q4_K plus qh[32] (a fifth bit)
    Q6_K 256 weights, 210 B: ql[128], qh[64], int8 scales[16] (sub-blocks of 16), d
                             w = d · sc_j · (q − 32)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gpu_kernels.quant.frozen import FrozenWeight

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian half floats -> (n, 1) fp32."""
    return b.contiguous().view(torch.float16).float()


@functools.cache
def _shifts(*bits: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Bit shifts on `device`, made once (no host-to-device copy inside a CUDA graph's capture)."""
    return torch.tensor(bits, dtype=torch.uint8, device=device).view(shape)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """(n, groups · width) bytes -> (n, groups, 2, width): low nibbles, then high nibbles."""
    n = qs.shape[0]
    shift = _shifts(0, 4, shape=(1, 1, 2, 1), device=qs.device)
    return (qs.reshape(n, groups, 1, width) >> shift) & 0x0F


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) bytes of a little-endian uint32 -> (n, 32) its bits, bit i for weight i."""
    shift = torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8)
    return ((qh.unsqueeze(-1) >> shift) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(b[:, :2]), b[:, 2:]
    q = _nibbles(qs, 1, 16).reshape(b.shape[0], 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:]
    q = _nibbles(qs, 1, 16).reshape(b.shape[0], 32).float()
    return d * q + m


def _q5(b: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 5-bit codes (n, 32) of Q5_0/Q5_1 blocks whose qh starts at byte `offset`."""
    qh, qs = b[:, offset : offset + 4], b[:, offset + 4 :]
    low = _nibbles(qs, 1, 16).reshape(b.shape[0], 32)
    return low | (_high_bits32(qh) << 4), qs


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q, _ = _q5(b, 2)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q, _ = _q5(b, 4)
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, each (n, 8) uint8."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d · sc_j, dmin · m_j), each (n, 8, 1) fp32, of Q4_K/Q5_K blocks."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.float()).view(n, 8, 1), (dmin * mn.float()).view(n, 8, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, shift = _k_affine(b)
    q = _nibbles(b[:, 16:], 4, 32).reshape(n, 8, 32).float()
    return (scale * q - shift).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, shift = _k_affine(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    low = _nibbles(qs, 4, 32).reshape(n, 8, 32)
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 1, 8, 1)
    high = ((qh.reshape(n, 1, 1, 32) >> bits) & 1).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    return (scale * q - shift).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    scale = (d * scales.contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _nibbles(ql, 2, 64).reshape(n, 8, 32)
    shift = _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1), device=b.device)
    high = ((qh.reshape(n, 2, 1, 32) >> shift) & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (scale * q).reshape(n, QK_K)


# name -> (weights a block, bytes a block, dequantizer of (n, bytes) uint8 -> (n, weights) fp32)
BlockDequant = Callable[[torch.Tensor], torch.Tensor]
GGML_TYPES: dict[str, tuple[int, int, BlockDequant]] = {
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}


def dequantize_blocks(blocks: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """(n, type_size) uint8 blocks of `ggml_type` -> (n, block_size) fp32."""
    _, size, fn = GGML_TYPES[ggml_type]
    return fn(blocks.reshape(-1, size))


class GGMLWeight(FrozenWeight):
    """A frozen weight kept in one of `GGML_TYPES`' block formats."""

    def __init__(
        self, shape: tuple[int, int], dtype: torch.dtype, blocks: torch.Tensor, ggml_type: str
    ) -> None:
        if ggml_type not in GGML_TYPES:
            raise ValueError(f"GGML type {ggml_type} is not supported (supported: {', '.join(GGML_TYPES)})")
        per_block, size, _ = GGML_TYPES[ggml_type]
        out, n_in = shape
        if n_in % per_block or tuple(blocks.shape) != (out, n_in // per_block * size):
            raise ValueError(
                f"{ggml_type} blocks of shape {tuple(blocks.shape)} do not hold a ({out}, {n_in}) weight"
            )
        super().__init__(shape, dtype)
        self.blocks, self.ggml_type = blocks, ggml_type
        self.format = ggml_type

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"blocks": self.blocks}

    def with_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> FrozenWeight:
        return GGMLWeight(self.shape, dtype, tensors["blocks"], self.ggml_type)

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        return dequantize_blocks(self.blocks[start:stop], self.ggml_type).view(stop - start, self.in_features)
