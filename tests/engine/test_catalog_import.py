"""The API process lists models through worker.engine.catalog: it must not pull in torch."""

from __future__ import annotations

import subprocess
import sys

from tests.engine.conftest import REPO_ROOT


def test_catalog_and_cli_models_import_no_torch() -> None:
    code = (
        "import sys, worker.engine.catalog, worker.engine.pull, service.cli_models;"
        "heavy = sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules);"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == ""
