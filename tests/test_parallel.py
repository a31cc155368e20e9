"""tests/parallel.py, on a real `pytest -n 3 --dist loadgroup` run of a small suite in a temp dir:
units stay on one worker, slow units start in the first round, a `serial` test runs with nothing
beside it, not even another worker's shutdown."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.e2e.procs import ROOT, clean_env

CONFTEST = """
import os, time
from tests import parallel
from tests.parallel import pytest_collection_modifyitems, pytest_runtest_protocol, pytest_xdist_make_scheduler

def pytest_unconfigure(config):  # as the suite's conftest stops its servers
    if not parallel.is_worker(config):
        return
    with parallel.beside_other_tests(config):
        start = time.monotonic()
        time.sleep(0.5)
        with open(os.environ["RUN_LOG"], "a") as log:
            worker = os.environ["PYTEST_XDIST_WORKER"]
            log.write(f"shutdown-{worker} {worker} {start} {time.monotonic()}\\n")
"""
INI = """
[pytest]
markers =
    slow: long
    serial: alone
"""
TESTS = """
import os, time
import pytest

def run(name, seconds=0.3):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["RUN_LOG"], "a") as log:
        log.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']} {start} {time.monotonic()}\\n")

@pytest.fixture(scope="module")
def per_module():
    return 1

@pytest.fixture(scope="session", params=["a", "b"])
def per_param(request):
    return request.param

@pytest.mark.parametrize("i", range(6))
def test_single(i):
    run(f"single{i}")

@pytest.mark.parametrize("i", range(3))
def test_module_unit(per_module, i):
    run(f"module{i}")

@pytest.mark.parametrize("i", range(2))
def test_param_unit(per_param, i):
    run(f"param-{per_param}{i}")

@pytest.mark.serial
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    run(f"serial{i}")

@pytest.mark.slow
def test_long():
    run("slow", 2)
"""


def top_level_env(**extra: str) -> dict[str, str]:
    """A clean environment without the variables xdist gives this test's own worker."""
    return {k: v for k, v in clean_env(**extra).items() if not k.startswith("PYTEST_XDIST_")}


def test_units_order_and_serial_on_three_workers(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "pytest.ini").write_text(INI)
    (suite / "test_suite.py").write_text(textwrap.dedent(TESTS))
    log = tmp_path / "run.log"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3", "--dist", "loadgroup",
         f"--basetemp={tmp_path / 'basetemp'}"],
        cwd=suite, env=top_level_env(PYTHONPATH=str(ROOT), RUN_LOG=str(log)), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    runs: dict[str, tuple[str, float, float]] = {}
    for line in log.read_text().splitlines():
        name, worker, started, ended = line.split()
        runs[name] = (worker, float(started), float(ended))
    assert len(runs) == 19, runs  # 16 tests, 3 workers' shutdowns

    def workers(prefix: str) -> set[str]:
        return {worker for name, (worker, _, _) in runs.items() if name.startswith(prefix)}

    assert len(workers("module")) == 1  # the module-scoped fixture's users: one worker
    assert len(workers("param-")) == 1  # the parametrized session fixture's users: one worker
    assert len(workers("")) == 3
    assert runs["slow"][1] < min(end for _, _, end in runs.values())  # in the first round
    for serial in ("serial0", "serial1"):
        _, start, end = runs[serial]
        beside = [n for n, (_, s, e) in runs.items() if n != serial and s < end and e > start]
        assert beside == [], (serial, beside)
