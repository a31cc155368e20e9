"""Int8 with one absmax scale per output row (LLM.int8's weight format, without its outliers).

s_r = max_j |W[r, j]| / 127,    q[r, j] = round(W[r, j] / s_r) ∈ [−127, 127] (int8),
Ŵ[r, j] = q[r, j] · s_r          (s_r fp32)
"""

from __future__ import annotations

import functools

import torch

from gpu_kernels.quant import compiled
from gpu_kernels.quant.frozen import FrozenWeight


class Int8Weight(FrozenWeight):
    format = "int8"

    def __init__(
        self,
        shape: tuple[int, int],
        dtype: torch.dtype,
        codes: torch.Tensor,  # (out, in) int8
        scale: torch.Tensor,  # (out,) fp32
    ) -> None:
        super().__init__(shape, dtype)
        self.codes, self.scale = codes, scale

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale": self.scale}

    def with_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> FrozenWeight:
        return Int8Weight(self.shape, dtype, tensors["codes"], tensors["scale"])

    def dequant_rows(self, start: int, stop: int) -> torch.Tensor:
        return self.codes[start:stop].float() * self.scale[start:stop].unsqueeze(-1)

    @functools.cached_property
    def _kernel_fits(self) -> bool:
        return compiled.takes(self.in_features, compiled.WEIGHTS_PER_THREAD, self.codes, self.scale)

    def _compiled_tile_into(self, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
        return compiled.int8_into(out, start, self.codes, self.scale)


def quantize_int8(weight: torch.Tensor, *, dtype: torch.dtype | None = None) -> Int8Weight:
    """Row-wise absmax int8 of `weight` (out, in), on its device."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / 127  # (out,)
    codes = torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return Int8Weight(tuple(weight.shape), dtype or weight.dtype, codes.contiguous(), scale.contiguous())  # type: ignore[arg-type]
