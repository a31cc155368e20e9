"""Fixtures: the real stack per test (tests/dashboard/stack.py) and the screenshot folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dashboard.stack import pytest_runtest_makereport, stack, stack_redis_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS
