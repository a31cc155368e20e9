"""A LoRA op's input that is an RMSNorm's output, kept as what the norm keeps anyway.

A decoder layer feeds each norm's output n = (offset + w) ⊙ x · rstd (M, D) to LoRA ops (q/k/v
after the attention norm, gate/up after the MLP norm), and each such op kept n for its backward:
dA = Uᵀ·n, U = dY·Dᵀ (M, R). The norm keeps x and rstd for its own backward, so

    dA = Uᵀ·n = ((U ⊙ rstd)ᵀ·x) ⊙ (offset + w)        (R, D)

needs no n: U scaled by rstd row by row (M, R), one GEMM reading x where the op read n, and w's
scale on the small result. One (M, D) tensor less per norm and layer, no more reads. In exact
arithmetic the two are equal; in bf16 n was rounded once after the scale, here U ⊙ rstd is.

The fused decoder (worker/engine/fused_model.py) hands a `NormSource` to the ops of a norm whose
input the norm keeps (gpu_kernels.add_rms_norm returns it); the ops keep it instead of n when
nothing else needs n in their backward (no LoRA dropout, frozen base).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormSource:
    """n = (offset + weight) ⊙ x · rstd: x (M, D) and rstd (M,) fp32 as the norm keeps them
    (detached: they carry no gradient through here), weight (D,)."""

    x: torch.Tensor
    rstd: torch.Tensor
    weight: torch.Tensor
    offset: float

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What an op saves for its backward in place of n (storage the norm keeps already)."""
        return self.x, self.rstd, self.weight


def lora_input_grad(
    u: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, offset: float
) -> torch.Tensor:
    """Uᵀ·n (R, D) from U (M, R) and a NormSource's tensors: the GEMM in x's dtype, the scales in
    fp32 (fp64 for fp64 x), the result in that precision."""
    acc = torch.promote_types(x.dtype, torch.float32)
    scaled = (u.to(acc) * rstd.to(acc)[:, None]).to(x.dtype)  # (M, R): U ⊙ rstd
    # w in x's dtype first, as the norm's kernel reads it
    return (scaled.t() @ x).to(acc) * (weight.to(x.dtype).to(acc) + offset)  # (R, D)
