"""The kernels' switches in one value: which path runs, how the LoRA term meets the base GEMM, and
where compiled libraries are cached.

This package reads no environment. The defaults below hold until a program calls `configure`,
before its first op: the worker does (worker/kernels.py, from LORAQ_KERNELS, LORAQ_RANK_UPDATE and
LORAQ_KERNEL_CACHE), and passes `current_config()` on to its torchrun ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpu_kernels import backend
from gpu_kernels.backend import Backend
from gpu_kernels.ops import lora
from gpu_kernels.ops.lora import RankUpdate


@dataclass(frozen=True)
class KernelConfig:
    backend: Backend = "auto"  # "reference": the plain-torch ops even on a GPU
    rank_update: RankUpdate = "epilogue"  # see gpu_kernels/ops/lora.py
    cache_dir: Path | None = None  # None: ~/.cache/loraq/kernels


def configure(config: KernelConfig) -> None:
    """Apply `config` to this process (raises ValueError on an unknown backend or order)."""
    from gpu_kernels import build  # lazy, as in _lib: `python -m gpu_kernels.build` runs it as __main__

    backend.set_backend(config.backend)
    lora.set_rank_update(config.rank_update)
    build.set_cache_dir(config.cache_dir)


def current_config() -> KernelConfig:
    """What this process runs with now."""
    from gpu_kernels import build

    return KernelConfig(backend.get_backend(), lora.get_rank_update(), build._cache_dir)
