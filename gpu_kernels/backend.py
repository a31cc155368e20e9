"""Which implementation an op call runs: the compiled kernels or the plain-torch reference.

The compiled path runs when every tensor of the call is on a CUDA device, the kernels built and
loaded, and the backend is "auto" (the default). `set_backend("reference")` forces the plain-torch
twins everywhere, which is how the GPU check trains the same model on both paths (a worker sets it
from LORAQ_KERNELS through `gpu_kernels.configure`: this package reads no environment). Its own
module so that both gpu_kernels.dispatch and the frozen-weight formats (gpu_kernels.quant, which
dispatch imports) can ask.
"""

from __future__ import annotations

from typing import Literal

import torch

from gpu_kernels import _lib

Backend = Literal["auto", "reference"]
_backend: Backend = "auto"


def set_backend(backend: Backend) -> None:
    global _backend
    if backend not in ("auto", "reference"):
        raise ValueError(f"backend must be 'auto' or 'reference', not {backend!r}")
    _backend = backend


def get_backend() -> Backend:
    return _backend


def compiled(*tensors: torch.Tensor | None) -> bool:
    """Whether a call on `tensors` runs the compiled kernels (all on CUDA, built, not forced off)."""
    if _backend == "reference":
        return False
    if not all(t is None or t.is_cuda for t in tensors):
        return False
    try:
        _lib.load()
    except RuntimeError:
        return False
    return True
