"""The API process lists models through worker.engine.catalog and checks uploads with
worker.engine.dataset_rules: neither may pull in torch."""

from __future__ import annotations

from tests.engine.conftest import loaded_after


def test_catalog_and_cli_models_import_no_torch() -> None:
    code = "import worker.engine.catalog, worker.engine.pull, service.cli_models"
    assert loaded_after(code, ("torch", "transformers", "tokenizers")) == []


def test_dataset_rules_and_upload_summary_import_no_torch() -> None:
    code = "import worker.engine.dataset_rules, service.api.dataset_summary"
    assert loaded_after(code, ("torch", "transformers", "tokenizers")) == []
