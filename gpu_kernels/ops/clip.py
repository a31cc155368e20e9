"""Sync-free global-norm gradient clipping over fp32 CUDA gradients (csrc/clip.cu).

Three launches (square-norm partials, reduce + scale on the device, scale), no host sync, so a
CUDA graph can capture it. The norm comes back as a 0-d device tensor; a non-finite norm leaves
the grads unscaled and, with a `nonfinite_state` tensor, records the step on the device for the
host to read every K steps.
"""

from __future__ import annotations

import ctypes

import torch

from gpu_kernels import _lib


def clip_grad_norm_(
    grads: list[torch.Tensor], max_norm: float, nonfinite_state: torch.Tensor | None = None
) -> torch.Tensor:
    """grads: non-empty fp32 contiguous CUDA tensors on one device. Returns the norm (0-d fp32)."""
    lib = _lib.load()
    device = grads[0].device
    grads = [g for g in grads if g.numel() > 0]
    n = len(grads)
    ptrs = (ctypes.c_void_p * n)(*[g.data_ptr() for g in grads])
    numels = (ctypes.c_int64 * n)(*[g.numel() for g in grads])
    n_partials = int(lib.loraq_clip_partials(numels, n))
    partials = torch.empty(n_partials, dtype=torch.float32, device=device)
    out = torch.empty(2, dtype=torch.float32, device=device)  # [norm, scale]
    rc = lib.loraq_clip_grad_norm(
        ptrs, numels, n, float(max_norm), partials.data_ptr(), out.data_ptr(), out.data_ptr() + 4,
        _lib.ptr(nonfinite_state), _lib.stream(device),
    )  # fmt: skip
    _lib.check(rc, "loraq_clip_grad_norm")
    return out[0]
