"""The API process lists models through worker.engine.catalog: it must not pull in torch."""

from __future__ import annotations

from tests.engine.conftest import loaded_after


def test_catalog_and_cli_models_import_no_torch() -> None:
    code = "import worker.engine.catalog, worker.engine.pull, service.cli_models"
    assert loaded_after(code, ("torch", "transformers", "tokenizers")) == []
