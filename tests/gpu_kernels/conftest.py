"""`gpu`-marked tests in this folder skip cleanly on machines without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
