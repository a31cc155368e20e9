"""Engines and sessions.

- `get_engine(url)`: one engine per URL per process (SQLite gets WAL, a busy timeout and foreign
  keys, so the API and a worker can use the same file at once).
- `get_session`: the FastAPI request-scoped dependency (`SessionDep`); commits on success.
- `session_scope()`: the same for the worker and the CLI, as a context manager.
- `run_read()`: a read on a bare pooled connection for async hot paths (status polling, key
  lookups): no Session to build, nothing to commit.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Concatenate, ParamSpec, TypeVar

from fastapi import Depends
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings, get_settings

P = ParamSpec("P")
T = TypeVar("T")

SQLITE_BUSY_TIMEOUT_MS = 30_000
PG_CONNECT_TIMEOUT_S = 5

_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_factories: dict[str, sessionmaker[Session]] = {}


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # Connections are cheap file handles; enough for every request thread (anyio's 40) at once.
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, pool_size=32, max_overflow=32
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # connect_timeout: an unreachable server fails a request (and /readyz) in seconds, not after
    # the kernel's TCP timeout of minutes.
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=10,
        max_overflow=30,
        connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S},
    )


_default_url: tuple[Settings, str] | None = None


def default_url() -> str:
    """The settings' database URL, resolved once per Settings object (it resolves paths on disk,
    too slow to repeat on every request)."""
    global _default_url
    settings = get_settings()
    if _default_url is None or _default_url[0] is not settings:
        _default_url = (settings, settings.resolved_database_url)
    return _default_url[1]


def get_engine(url: str | None = None) -> Engine:
    url = url or default_url()
    with _lock:
        if url not in _engines:
            _engines[url] = make_engine(url)
            _factories[url] = sessionmaker(_engines[url], expire_on_commit=False)
        return _engines[url]


def session_factory(url: str | None = None) -> sessionmaker[Session]:
    url = url or default_url()
    get_engine(url)
    return _factories[url]


def dispose_engines() -> None:
    """Close every pooled connection (tests dropping a database; a forked process)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
        _factories.clear()


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits when the block ends normally and rolls back on an exception."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


async def get_session() -> AsyncIterator[Session]:
    with session_scope() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


async def run_read(fn: Callable[Concatenate[Connection, P], T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(conn, *args, **kwargs)` on a pooled connection, for read-only hot paths in async routes
    and dependencies: no Session to build, nothing to commit.

    SQLite runs it inline on the event loop: a local file, and in WAL mode a reader never waits
    for a writer, so an indexed lookup takes tens of µs, several times less than a threadpool
    handoff (measured: 0.32 vs 0.75 ms of API CPU per status read). pysqlite begins no
    transaction for a SELECT, so returning the connection costs nothing either.

    A server database (PostgreSQL) is read on the threadpool, so a slow network or server never
    stalls the loop, in AUTOCOMMIT: the SELECT is its own transaction and the connection goes
    back to the pool without a ROLLBACK round trip.
    """
    engine = get_engine()
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            return fn(conn, *args, **kwargs)

    def read() -> T:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            return fn(conn, *args, **kwargs)

    return await run_in_threadpool(read)
