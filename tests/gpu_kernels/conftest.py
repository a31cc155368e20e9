"""Fixtures and hooks of the kernel tests.

- `gpu`-marked tests skip cleanly on machines without a CUDA device; on one, each runs with the
  kernels configured from the settings (LORAQ_KERNEL_CACHE: where gpu_check.sh built them), the
  compiled kernels required (a failed build is an error, not a silent reference run), TF32 off
  (the fp32 bounds assume full fp32 GEMMs) and a fixed seed.
- `--n-gpus N` (default 2): how many GPUs test_gpu_training's multi-GPU test compares with one.
- `--gpu-results PATH` writes every test's outcome, with the errors it recorded through
  `record_property`, as JSON (scripts/gpu_check.sh keeps it in bench/results).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
_rows: list[dict[str, Any]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--gpu-results", type=Path, default=None, help="write each test's outcome and errors as JSON here"
    )
    parser.addoption("--n-gpus", type=int, default=2, help="GPUs of the multi-GPU training test")


@pytest.fixture
def n_gpus(request: pytest.FixtureRequest) -> int:
    return int(request.config.getoption("--n-gpus"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _compiled_kernels_on_gpu(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import gpu_kernels
    from worker.kernels import configure_kernels

    configure_kernels()  # the kernel cache (and switches) of the settings, as a worker applies them
    gpu_kernels.require_compiled()
    assert gpu_kernels.available().compiled
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" or report.outcome != "passed":
        row: dict[str, Any] = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
        row.update(dict(report.user_properties))
        _rows.append(row)


def _header() -> dict[str, Any]:
    """Where and on what the results were measured."""
    from bench.train_bench import git_commit
    from worker.engine.versions import package_versions

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name(0) if cuda else "none",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "versions": package_versions(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--gpu-results", default=None)
    if path is None:
        return
    failed = [r["test"] for r in _rows if r["outcome"] == "failed"]
    path.write_text(json.dumps({**_header(), "checks": _rows, "failed": failed}, indent=1, default=str))
