"""The versions of the packages a training run depends on, for benchmark and check records.

Read from the installed distributions' metadata, so asking imports nothing (triton, for one, is
absent on CPU machines). The GPU image need not match requirements/cpu.txt, which is why every
result file says what it ran with."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

RECORDED = ("torch", "transformers", "peft", "triton", "liger-kernel", "safetensors", "accelerate")


def package_versions(names: tuple[str, ...] = RECORDED) -> dict[str, str | None]:
    """{distribution name: installed version, or None when it is not installed}."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found
