"""The kernels' switches from the settings: gpu_kernels imports only torch and reads no
environment, so every program that trains or serves (the Celery worker, `loraq inference`,
`loraq train`, bench/, scripts/) calls `configure_kernels` before its first op."""

from __future__ import annotations

from service.settings import Settings, get_settings


def configure_kernels(settings: Settings | None = None) -> None:
    """Apply LORAQ_KERNELS, LORAQ_RANK_UPDATE and LORAQ_KERNEL_CACHE to this process's kernels."""
    import gpu_kernels  # here: importing this module must not load torch (the CLI, the launcher)

    settings = settings or get_settings()
    gpu_kernels.configure(
        gpu_kernels.KernelConfig(
            backend=settings.kernels, rank_update=settings.rank_update, cache_dir=settings.kernel_cache
        )
    )
