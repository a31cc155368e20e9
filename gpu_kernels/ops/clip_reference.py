"""Plain-torch global-norm gradient clipping with the device-side non-finite flag: the CPU
path of gpu_kernels.ops.clip and its test oracle."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def new_nonfinite_state(device: torch.device | str) -> torch.Tensor:
    """int64[2]: [first non-finite step (0 = none), steps counted]; see clip_grad_norm_."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def clip_grad_norm_(
    params: Iterable[torch.Tensor], max_norm: float, nonfinite_state: torch.Tensor | None = None
) -> torch.Tensor:
    """Scale grads in place so their global L2 norm is at most max_norm; returns the norm
    (before clipping) as a 0-d float32 tensor on the grads' device. Non-finite norms are
    returned as is and grads are left unscaled, for the caller to report. With
    `nonfinite_state` (see new_nonfinite_state) the step is counted and the first step with a
    non-finite norm is recorded there, on the device."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    norms = torch.stack([g.detach().float().norm(2) for g in grads])
    total = norms.norm(2)
    finite = torch.isfinite(total)
    # torch.where instead of `if finite:` keeps this free of host syncs
    coef = torch.where(finite, torch.clamp(max_norm / (total + 1e-6), max=1.0), torch.ones_like(total))
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    if nonfinite_state is not None:
        nonfinite_state[1] += 1
        first_bad = (nonfinite_state[0] == 0) & ~finite
        nonfinite_state[0] = torch.where(first_bad, nonfinite_state[1], nonfinite_state[0])
    return total
