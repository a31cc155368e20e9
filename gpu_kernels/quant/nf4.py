"""NF4 (QLoRA's 4-bit NormalFloat), blockwise, with optional double quantization.

Each row of W (out, in) is cut into blocks of `block` (64) consecutive weights; a block keeps its
absmax a = max|w| (fp32) and, per weight, the index of the nearest of the 16 NF4 code values c_k
to w / a, two indices a byte (the first weight of a pair in the high nibble, as bitsandbytes packs):

    ŵ = c[q] · a,     q = argmin_k |w / a − c_k|

The code values are bitsandbytes' NF4 table (Dettmers et al. 2023, appendix E: quantiles of
N(0, 1) scaled to [−1, 1], with an exact 0). Double quantization (`double_quant=True`) stores the
absmaxes themselves in 8 bits: centred on their mean, in groups of 256, each group's absmax in
fp32 and codes q₂ = round(127 · (a − mean) / group absmax) as int8 (a linear code; bitsandbytes
uses its dynamic 8-bit map here, so double-quantized tensors are ours, not bitsandbytes'):
0.5 bit a weight for the scales becomes ~0.127.
"""

from __future__ import annotations

import functools

import torch

from gpu_kernels.quant import compiled
from gpu_kernels.quant.frozen import FrozenWeight

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
NF4_BLOCK = 64
DQ_GROUP = 256  # absmaxes per second-level group (QLoRA's choice)


@functools.cache
def _pair_code(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: the two code values a packed byte holds (high nibble first), made once."""
    byte = torch.arange(256)
    return torch.tensor(NF4_CODE, dtype=torch.float32)[torch.stack([byte >> 4, byte & 0x0F], dim=-1)].to(
        device
    )


@functools.cache
def _code(device: torch.device) -> torch.Tensor:
    """The code table on `device`, made once: a host-to-device copy cannot run inside a CUDA
    graph's capture (the first, eager step makes it)."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


class NF4Weight(FrozenWeight):
    format = "nf4"

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        packed: torch.Tensor,  # (out, in / 2) uint8: two 4-bit code indices a byte
        absmax: torch.Tensor | None,  # (out, in / block) fp32 (None when double-quantized)
        block: int = NF4_BLOCK,
        dq_codes: torch.Tensor | None = None,  # (out · in / block,) int8
        dq_scale: torch.Tensor | None = None,  # (groups,) fp32: each group's |a − mean| max / 127
        dq_mean: torch.Tensor | None = None,  # () fp32
    ) -> None:
        super().__init__(shape, dtype)
        self.packed, self.absmax, self.block = packed, absmax, block
        self.dq_codes, self.dq_scale, self.dq_mean = dq_codes, dq_scale, dq_mean

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {
            "packed": self.packed,
            "absmax": self.absmax,
            "dq_codes": self.dq_codes,
            "dq_scale": self.dq_scale,
            "dq_mean": self.dq_mean,
        }
        return {k: t for k, t in named.items() if t is not None}

    def with_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> FrozenWeight:
        return NF4Weight(
            self.shape,
            dtype,
            tensors["packed"],
            tensors.get("absmax"),
            self.block,
            tensors.get("dq_codes"),
            tensors.get("dq_scale"),
            tensors.get("dq_mean"),
        )

    def block_absmax(self, start: int, stop: int) -> torch.Tensor:
        """The absmax of every block of rows start:stop, (stop - start, in / block) fp32."""
        per_row = self.in_features // self.block
        if self.absmax is not None:
            return self.absmax[start:stop]
        assert self.dq_codes is not None and self.dq_scale is not None and self.dq_mean is not None
        lo, hi = start * per_row, stop * per_row
        groups = torch.arange(lo, hi, device=self.dq_codes.device) // DQ_GROUP
        absmax = self.dq_codes[lo:hi].float() * self.dq_scale[groups] + self.dq_mean
        return absmax.view(stop - start, per_row)

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        packed = self.packed[start:stop]  # (rows, in / 2)
        # each byte looks up its two values at once: (rows, in / 2) int32 -> (rows, in / 2, 2) fp32,
        # the tile's only temporaries besides the result (no int64 index per weight)
        values = torch.index_select(_pair_code(packed.device), 0, packed.reshape(-1).int())
        blocks = values.view(stop - start, -1, self.block)
        return blocks.mul_(self.block_absmax(start, stop).unsqueeze(-1)).view(stop - start, self.in_features)

    @functools.cached_property
    def _kernel_fits(self) -> bool:
        return compiled.takes(self.in_features, self.block, *self.tensors().values())

    def _compiled_tile_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        dq = None
        if self.absmax is None:
            assert self.dq_codes is not None and self.dq_scale is not None and self.dq_mean is not None
            dq = (self.dq_codes, self.dq_scale, self.dq_mean)
        return compiled.nf4_into(out, start, self.packed, self.absmax, dq, self.block)


def quantize_nf4(
    weight: torch.Tensor,
    *,
    block: int = NF4_BLOCK,
    double_quant: bool = False,
    dtype: torch.dtype | None = None,
) -> NF4Weight:
    """NF4 of `weight` (out, in), on its device; `dtype` (default: the weight's) is the dtype the
    quantized layer computes in. in must be a multiple of `block` (every real model's is)."""
    out, n_in = weight.shape
    if n_in % block:
        raise ValueError(f"NF4 needs in_features divisible by {block}, got {n_in}")
    w = weight.detach().float().view(out, n_in // block, block)
    absmax = w.abs().amax(dim=-1)  # (out, in / block)
    scaled = w / absmax.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    code = _code(w.device)
    # nearest code value: the midpoints between neighbours split [-1, 1] into 16 bins
    midpoints = (code[1:] + code[:-1]) / 2
    q = torch.bucketize(scaled.reshape(out, n_in), midpoints).to(torch.uint8)  # (out, in)
    pairs = q.view(out, n_in // 2, 2)
    packed = (pairs[..., 0] << 4) | pairs[..., 1]
    target = dtype or weight.dtype
    if not double_quant:
        return NF4Weight((out, n_in), target, packed.contiguous(), absmax.contiguous(), block)
    flat = absmax.reshape(-1)
    mean = flat.mean()
    centred = flat - mean
    pad = (-flat.numel()) % DQ_GROUP
    groups = torch.nn.functional.pad(centred, (0, pad)).view(-1, DQ_GROUP)
    scale = groups.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (groups,)
    codes = torch.round(groups / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).view(-1)
    return NF4Weight(
        (out, n_in), target, packed.contiguous(), None, block, codes[: flat.numel()].contiguous(), scale, mean
    )
