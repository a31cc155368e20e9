"""`pytest --cpu-times PATH`: each test's CPU seconds, appended to PATH as JSON lines.

The suite is CPU-bound on a 2-core CI machine (both cores busy for most of a run), so wall time
(`--durations`) misleads: a test waiting 120 s on a Redis stall costs little, while one training
a model on both cores costs much. Each line holds the test's node id, its wall seconds and the
CPU seconds (user + system) of this process and of every descendant alive at its start or end,
children they have reaped included, taken across setup, call and teardown. A descendant that
exits unreaped by a live one is missed, so the figure is a lower bound. xdist workers append to
the same file; each line is one write to a file opened for appending, so lines do not interleave.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

OPTION = "--cpu-times"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION, type=Path, default=None, help="append each test's CPU seconds to this JSON-lines file"
    )


def tree_cpu_seconds() -> float:
    """CPU seconds of this process and its live descendants, their reaped children included."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited since the listing
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path: Path | None = item.config.getoption(OPTION)
    if path is None:
        return (yield)
    cpu, wall = tree_cpu_seconds(), time.monotonic()
    try:
        return (yield)
    finally:
        line = {
            "test": item.nodeid,
            "cpu_s": round(tree_cpu_seconds() - cpu, 2),
            "wall_s": round(time.monotonic() - wall, 2),
        }
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
