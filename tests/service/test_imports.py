"""The API process never imports torch (or the training engine's heavy modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from service.app import create_app
app = create_app()
app.openapi()
import service.jobs, service.queue, service.storage, service.auth, service.reaper, service.ratelimit
names = ("torch", "transformers", "peft", "worker.engine.recipe", "worker.runner", "worker.celery_app")
heavy = sorted(m for m in names if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


def test_importing_the_app_does_not_import_torch(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "LORAQ_DATA_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip().splitlines()[-1] == "HEAVY=", out.stdout + out.stderr
