"""The API process lists models through worker.engine.catalog, checks uploads with
worker.engine.dataset_rules, says what a job holds out with worker.engine.holdout and validates
jobs with worker.engine.training_config: none of them may pull in torch."""

from __future__ import annotations

from tests.engine.conftest import loaded_after


def test_catalog_and_cli_models_import_no_torch() -> None:
    # the Hub look-up too: the API runs it at submit (service/hub_models.py)
    code = (
        "import worker.engine.catalog, worker.engine.pull, worker.engine.hub, service.hub_models, "
        "service.cli_models"
    )
    assert loaded_after(code, ("torch", "transformers", "tokenizers")) == []


def test_dataset_rules_and_upload_summary_import_no_torch() -> None:
    code = "import worker.engine.dataset_rules, worker.engine.holdout, service.api.dataset_summary"
    assert loaded_after(code, ("torch", "transformers", "tokenizers")) == []


def test_training_config_and_job_schemas_import_no_torch() -> None:
    # the API's request schema is built from the training configuration type
    code = "import worker.engine.training_config, worker.engine.types, service.schemas"
    assert loaded_after(code, ("torch", "transformers", "tokenizers")) == []
