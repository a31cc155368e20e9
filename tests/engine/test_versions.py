"""Result files record the versions they ran with (worker.engine.versions)."""

from __future__ import annotations

from importlib.metadata import version

from worker.engine.versions import package_versions


def test_installed_and_missing_packages() -> None:
    found = package_versions(("torch", "transformers", "not-a-package-loraq"))
    assert found["torch"] == version("torch") and found["torch"].startswith("2.")
    assert found["transformers"] == version("transformers")
    assert found["not-a-package-loraq"] is None
