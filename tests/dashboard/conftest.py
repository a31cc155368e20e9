"""Fixtures: the real stack per test (tests/dashboard/stack.py) and the screenshot folder; a page
signed in with a key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.stack import pytest_runtest_makereport, stack, stack_redis_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@contextmanager
def keyed_page(browser: Any, api_key: str, width: int) -> Iterator[tuple[Any, list[str]]]:
    """A page of a new context `width` px wide whose dashboard holds `api_key`, and the page's
    uncaught errors (the caller asserts there are none)."""
    context = browser.new_context(viewport={"width": width, "height": 900})
    context.add_init_script(f"localStorage.setItem('loraq.apiKey', {json.dumps(api_key)})")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        yield page, errors
    finally:
        context.close()
