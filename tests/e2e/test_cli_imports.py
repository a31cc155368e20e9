"""The `loraq` command stays light: `--help` and the HTTP commands never import torch."""

from __future__ import annotations

import subprocess
import sys

from tests.e2e.procs import ROOT, clean_env

PROBE = """
import sys
from typer.testing import CliRunner
from service.cli import app
result = CliRunner().invoke(app, sys.argv[1:])
assert result.exit_code == 0, result.output
heavy = sorted(m for m in ("torch", "transformers", "worker.engine.recipe") if m in sys.modules)
print("HEAVY:" + ",".join(heavy))
print(result.output)
"""


def run_probe(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_help_lists_every_command_without_importing_torch() -> None:
    out = run_probe("--help")
    assert "HEAVY:\n" in out
    for command in ("up", "worker", "keys", "files", "jobs"):
        assert command in out


def test_jobs_help_lists_subcommands_without_importing_torch() -> None:
    out = run_probe("jobs", "--help")
    assert "HEAVY:\n" in out
    for command in ("create", "list", "get", "cancel", "events", "watch", "download"):
        assert command in out
