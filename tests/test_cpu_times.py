"""tests/cpu_times.py on a real `pytest -n 2` run of a small suite in a temp dir: a test whose
child process burns CPU is charged that CPU, a test that only sleeps is charged almost none, and
each test's line arrives whole in the one file the workers share (xdist may run both tests on one
worker, so this does not prove two workers' writes never interleave)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.e2e.procs import ROOT
from tests.test_parallel import top_level_env

TESTS = """
import subprocess, sys, time

BURN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"

def test_burns_in_a_child():
    subprocess.run([sys.executable, "-c", BURN], check=True)

def test_sleeps():
    time.sleep(0.6)
"""


def test_cpu_times_charges_a_childs_cpu_and_not_a_sleep(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text('pytest_plugins = ("tests.cpu_times",)\n')
    (suite / "test_suite.py").write_text(textwrap.dedent(TESTS))
    report = tmp_path / "cpu.jsonl"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", f"--cpu-times={report}",
         f"--basetemp={tmp_path / 'basetemp'}"],
        cwd=suite, env=top_level_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    by_test = {line["test"].split("::")[-1]: line for line in lines}
    assert sorted(by_test) == ["test_burns_in_a_child", "test_sleeps"] and len(lines) == 2
    burn, sleep = by_test["test_burns_in_a_child"], by_test["test_sleeps"]
    assert burn["cpu_s"] >= 0.55, burn  # the child's 0.6 s of CPU, reaped by the worker
    assert sleep["wall_s"] >= 0.6 and sleep["cpu_s"] < 0.3, sleep
