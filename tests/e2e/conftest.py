"""Fixtures that run the real service as separate processes.

- `redis_url`: a private `redis-server` on a free port for the test session;
- `e2e_db_url`: SQLite (a file in the test's tmp dir) and PostgreSQL (a fresh database on the
  suite's server, dropped afterwards), as a parameter, so every flow runs on both;
- `service`: migrations applied, an API key made with `loraq keys create`, a uvicorn API process
  and a `loraq worker` process (Celery, solo pool) on a queue private to the test.

Processes run with a clean `LORAQ_*` environment and their own data dir; their logs are printed
when a test fails so a failure says what the worker did.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.procs import Service, running_service
from tests.servers import create_pg_database, drop_pg_database, start_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def e2e_db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'loraq.db'}"
        return
    name, url = create_pg_database("loraq_e2e")
    yield url
    drop_pg_database(name)


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory, e2e_db_url: str, redis_url: str) -> Iterator[Service]:
    """One API + worker pair per database for the whole session (starting a worker imports torch,
    which takes tens of seconds on a busy 2-core machine). Tests share it: each works on its own
    jobs, and a test that needs its own job list uses its own tenant (`Service.new_key`)."""
    with running_service(tmp_path_factory.mktemp("service"), e2e_db_url, redis_url) as svc:
        yield svc


@pytest.fixture
def e2e(service: Service, request: pytest.FixtureRequest) -> Iterator[Service]:
    """`service`, printing the tail of the API and worker logs when the test fails."""
    yield service
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for name in service.logs:
            print(f"--- {name} log (tail)\n{service.log_text(name)[-6000:]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep
