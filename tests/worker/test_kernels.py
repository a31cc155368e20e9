"""The kernels' switches travel from the settings to gpu_kernels (which reads no environment),
and from the worker to its torchrun ranks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import gpu_kernels
from service.settings import Settings
from worker.engine import distributed
from worker.kernels import configure_kernels


@pytest.fixture
def restore_kernels() -> Iterator[None]:
    before = gpu_kernels.current_config()
    yield
    gpu_kernels.configure(before)


@pytest.mark.usefixtures("restore_kernels")
def test_settings_reach_the_kernels_and_the_torchrun_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAQ_KERNELS", "reference")
    monkeypatch.setenv("LORAQ_RANK_UPDATE", "kernel")
    monkeypatch.setenv("LORAQ_KERNEL_CACHE", str(tmp_path))
    configure_kernels(Settings())
    chosen = gpu_kernels.KernelConfig(backend="reference", rank_update="kernel", cache_dir=tmp_path)
    assert gpu_kernels.current_config() == chosen
    argv = distributed.torchrun_argv(tmp_path / "config.json", tmp_path, 2)
    ranks = argv[argv.index("worker.engine.distributed") + 1 :]
    assert ranks == [str(tmp_path / "config.json"), str(tmp_path), *distributed.kernel_args(chosen)]
    assert ranks[2:] == ["--kernels", "reference", "--rank-update", "kernel", "--kernel-cache", str(tmp_path)]
    configure_kernels(Settings(kernels="auto", rank_update="epilogue", kernel_cache=None))
    assert gpu_kernels.current_config() == gpu_kernels.KernelConfig()  # the defaults


def test_an_unknown_switch_is_refused_by_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic import ValidationError

    monkeypatch.setenv("LORAQ_RANK_UPDATE", "fast")
    with pytest.raises(ValidationError, match="rank_update"):
        Settings()
