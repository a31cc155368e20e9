"""How the suite shares a machine between xdist workers (`make test` runs `pytest -n 3 --dist
loadgroup`): most real-process tests wait (processes starting, sleeps, Redis stalls), so three
workers finish sooner than one even on 2 cores. Each worker starts its own throwaway Redis and
PostgreSQL (tests/servers.py) and session fixtures, on free ports and in its own temp dirs.

- Units: a test that uses a module- or class-scoped fixture runs on the worker that runs the rest
  of its module, so the fixture starts once (a `loraq up`, a real model); a test that uses a
  parametrized session-scoped fixture runs with every other user of that fixture (tests/e2e's
  `service`, an API and a worker per database), so each parameter starts once, as in a sequential
  run. An `xdist_group` mark names a unit explicitly. Any other test is a unit of its own.
- Order: units holding a `slow` test go first, so the longest (the README quickstart, the Redis
  stalls) do not start last and hold up the end; then groups, then single tests; `serial` last.
- `serial`: a test that must not run beside others (a sub-second timing bound, thousands of
  sockets) runs alone. Every other test holds a shared lock while it runs and a `serial` test the
  exclusive one; a turnstile stops new tests from starting while a `serial` test waits, so it
  cannot be starved. The wait is outside the test's timeout. A worker that has run out of tests
  takes the shared lock too while it stops its servers (`beside_other_tests`): a serial test
  placed last would otherwise run beside the other workers' shutdown.

The workers know the units (they collect; the controller only sees node ids), so each writes its
map of node id to unit into the run's base temp dir, where the controller's scheduler reads it.
(xdist's own loadgroup appends the group to the node id, which pytest 9.2's structured node ids
silently ignore: pytest-xdist issue 1386.)

Run without `-n`, none of this applies: tests run in pytest's own order, in one process.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUP_MARK = "xdist_group"
SERIAL_MARK = "serial"
UNITS_FILE = "xdist-units.json"


def is_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker. From the config, not xdist's PYTEST_XDIST_WORKER
    variable, which every process a test starts inherits (a pytest run inside a test included)."""
    return hasattr(config, "workerinput")


def worker_count(config: pytest.Config) -> int:
    """How many workers share the machine (1 when the suite runs in one process)."""
    return int(config.workerinput["workercount"]) if is_worker(config) else 1  # type: ignore[attr-defined]


def run_dir(config: pytest.Config) -> Path:
    """A directory of this run that the controller and every worker see: the controller's base
    temp dir, whose `popen-gwN` subdirs are the workers' (so other people's runs never meet ours)."""
    basetemp: Path = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    return basetemp.parent if is_worker(config) else basetemp


def _group(item: pytest.Item) -> str | None:
    """The unit `item` shares with other tests (see the module docstring), or None."""
    mark = item.get_closest_marker(GROUP_MARK)
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    module_scoped = False
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs:
            continue
        if defs[-1].scope == "session" and defs[-1].params:
            return f"session fixture {name}"
        module_scoped = module_scoped or defs[-1].scope in ("module", "class")
    return item.nodeid.split("::", 1)[0] if module_scoped else None


def plan(items: list[pytest.Item], into: Path) -> None:
    """Order `items` for the scheduler (stably: a unit's tests keep pytest's order, which keeps
    the parameters of wide-scoped fixtures together) and write their units to `into`."""
    unit_of = {item.nodeid: _group(item) or item.nodeid for item in items}
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(unit_of[item.nodeid], []).append(item)

    def rank(unit: list[pytest.Item]) -> int:
        if any(i.get_closest_marker(SERIAL_MARK) for i in unit):
            return 3
        if any(i.get_closest_marker("slow") for i in unit):
            return 0
        return 1 if len(unit) > 1 else 2

    ranks = {key: rank(unit) for key, unit in units.items()}
    items.sort(key=lambda item: ranks[unit_of[item.nodeid]])
    # Every worker writes the same map; a rename, so the controller never reads half of one.
    fd, tmp = tempfile.mkstemp(dir=into, prefix=f".{UNITS_FILE}.")
    with os.fdopen(fd, "w") as out:
        json.dump({nodeid: unit for nodeid, unit in unit_of.items() if unit != nodeid}, out)
    os.replace(tmp, into / UNITS_FILE)


class UnitScheduling(LoadScopeScheduling):
    """xdist's load-by-scope scheduler with the workers' units as scopes, handed out in the
    order the workers collected (`plan`'s)."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # else it puts the biggest units first
        self._units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:  # read once every worker has collected (and so written it)
            self._units = json.loads((run_dir(self.config) / UNITS_FILE).read_text())
        return self._units.get(nodeid, nodeid)


@contextmanager
def run_lock(lock_dir: Path, exclusive: bool) -> Iterator[None]:
    """A fair readers-writer lock across the workers' processes (flock on two files)."""
    with open(lock_dir / "serial.turnstile", "a") as gate, open(lock_dir / "serial.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:  # a writer keeps the turnstile shut until it is done
                fcntl.flock(gate, fcntl.LOCK_UN)
        yield  # closing the files releases both locks


@contextmanager
def beside_other_tests(config: pytest.Config) -> Iterator[None]:
    """Hold the shared lock (on a worker) for work outside any test that loads the machine: a
    worker that has run out of tests stops its throwaway PostgreSQL and Redis while another may
    still run a `serial` test, whose timing bound is then measured beside the shutdown."""
    if not is_worker(config):
        yield
        return
    with run_lock(run_dir(config), exclusive=False):
        yield


# ------------------------------------------------------------------ hooks (tests/conftest.py imports them)
@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` schedules the units above."""
    return UnitScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    yield
    if is_worker(config):  # after pytest's own order
        plan(items, run_dir(config))


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout: the wait is not the test's
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if not is_worker(item.config):
        return (yield)
    with run_lock(run_dir(item.config), exclusive=item.get_closest_marker(SERIAL_MARK) is not None):
        return (yield)
