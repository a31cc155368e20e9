"""Engines and sessions.

- `get_engine(url)`: one engine per URL per process (SQLite gets WAL, a busy timeout and foreign
  keys, so the API and a worker can use the same file at once).
- `get_session`: the FastAPI request-scoped dependency (`SessionDep`); commits on success.
- `session_scope()`: the same for the worker and the CLI, as a context manager.
- `read_first()`: one row of a read-only statement for async hot paths (status polling, key
  lookups): no Session to build, nothing to commit; on PostgreSQL through a pipelined libpq
  connection on the event loop.
"""

from __future__ import annotations

import json
import threading
from collections import namedtuple
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Annotated, Any

from fastapi import Depends
from sqlalchemy import JSON, Boolean, ColumnElement, Dialect, Engine, Select, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from service.db.pipelined_reads import PG_CONNECT_TIMEOUT_S, Compiled, forget_read_pools, read_pool
from service.settings import Settings, get_settings

SQLITE_BUSY_TIMEOUT_MS = 30_000

_lock = threading.Lock()
_engines: dict[str, Engine] = {}
_factories: dict[str, sessionmaker[Session]] = {}

# PostgreSQL's application_name for this process's connections (pg_stat_activity). Worker
# processes use WORKER_APPLICATION: the reaper may end a worker session that sits inside a
# transaction past the heartbeat timeout (a frozen worker holding its job's row lock), and only
# those (end_idle_transactions).
WORKER_APPLICATION = "loraq-worker"
_application_name = "loraq"


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
        connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S, "application_name": _application_name},
    )


def set_application_name(name: str) -> None:
    """Name this process's PostgreSQL connections from now on (pooled ones are closed)."""
    global _application_name
    _application_name = name
    dispose_engines()


def set_lock_timeout(session: Session, seconds: float) -> None:
    """On PostgreSQL, this transaction waits at most `seconds` for a row lock, then fails
    (OperationalError) instead of waiting for ever. A no-op on SQLite."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SET LOCAL lock_timeout = '{int(seconds * 1000)}ms'"))


def end_idle_transactions(session: Session, *, application_name: str, idle_seconds: float) -> list[int]:
    """End (pg_terminate_backend) this database's sessions named `application_name` that have sat
    idle inside a transaction for over `idle_seconds`, releasing their locks; their pids. Such a
    session belongs to a process that stopped mid-transaction (SIGSTOP, a hung host): its own
    transactions last milliseconds. A no-op on SQLite (a file lock ends with its process)."""
    if session.get_bind().dialect.name != "postgresql":
        return []
    rows = session.execute(
        text(
            # the call sits in the select list: it runs only for the rows the filter kept
            "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = :name "
            "AND state = 'idle in transaction' AND pid <> pg_backend_pid() "
            "AND state_change < now() - make_interval(secs => :idle)"
        ),
        {"name": application_name, "idle": idle_seconds},
    ).all()
    return [int(r[0]) for r in rows]


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
        forget_read_pools()


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


async def read_first(stmt: Select[Any], params: dict[str, Any]) -> Any | None:
    """The first row of the read-only `stmt` as the driver returns it, or None: the async hot
    paths (status polling, key lookups), with no Session to build and nothing to commit.

    The row is a named tuple (attribute access by column label) of the driver's values, not
    SQLAlchemy's: a JSON column is its JSON text and, on SQLite, a boolean is 0 or 1
    (`decode_json_and_bools` turns them into what a Core row holds). Every value hashes, so a
    hot path can cache what it derives from a row under the row's values. Parameters go to the
    driver as given (no SQLAlchemy bind processing: strings and numbers only).

    SQLite runs it inline on the event loop on a pooled DBAPI connection: a local file, and in
    WAL mode a reader never waits for a writer, so an indexed lookup takes tens of µs, several
    times less than a threadpool handoff (measured: 0.32 vs 0.75 ms of API CPU per status
    read), and SQLAlchemy's Connection and Result around it cost four times the query (54 vs
    12 µs). pysqlite begins no transaction for a SELECT, so returning the connection costs
    nothing either.

    PostgreSQL is read on the event loop too, without blocking it, on a libpq connection in
    pipeline mode (`PipelinedReads`): the statement compiled once, prepared once per connection,
    in autocommit. The threadpool and SQLAlchemy's pool around each read cost several times the
    query itself (measured on the 2-core dev box: 0.54 ms of CPU per read through SQLAlchemy's
    asyncio bridge, 0.10 ms on a bare psycopg async connection, 0.02-0.04 ms pipelined).
    """
    engine = get_engine()
    if engine.dialect.name == "sqlite":
        return _sqlite_first(engine, _compiled(stmt, engine.dialect), params)
    return await read_pool(default_url()).first(_compiled(stmt, _pg_numeric_dialect()), params)


_compiled_sql: dict[tuple[Select[Any], str], Compiled] = {}


def _compiled(stmt: Select[Any], dialect: Dialect) -> Compiled:
    """`stmt` compiled once per dialect: hot-path statements are module constants."""
    key = (stmt, dialect.name)
    compiled = _compiled_sql.get(key)
    if compiled is None:
        c = stmt.compile(dialect=dialect)
        compiled = _compiled_sql[key] = Compiled(str(c), tuple(c.positiontup or ()))
    return compiled


@lru_cache(maxsize=1)
def _pg_numeric_dialect() -> Dialect:
    """PostgreSQL's dialect writing libpq's positional `$1` parameters (`PipelinedReads`)."""
    from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg

    return PGDialect_psycopg(paramstyle="numeric_dollar")


def _sqlite_first(engine: Engine, compiled: Compiled, params: dict[str, Any]) -> Any | None:
    conn = engine.raw_connection()
    try:
        cur = conn.cursor()
        cur.execute(compiled.sql, [params[name] for name in compiled.positions])
        values = cur.fetchone()
        if compiled.row is None:  # named by the driver's column names, as PostgreSQL's rows are
            compiled.row = namedtuple("Row", [d[0] for d in cur.description], rename=True)  # type: ignore[misc]
        cur.close()
    finally:
        conn.close()
    return None if values is None else compiled.row._make(values)  # type: ignore[attr-defined]


def decode_json_and_bools(columns: Sequence[ColumnElement[Any]], values: Sequence[Any]) -> list[Any]:
    """`values` of `columns`, read by `read_first`, as a Core row holds them: JSON text parsed,
    SQLite's 0/1 booleans as bools."""
    out = list(values)
    for i, column in enumerate(columns):
        if out[i] is None:
            continue
        if isinstance(column.type, JSON):
            out[i] = json.loads(out[i])
        elif isinstance(column.type, Boolean):
            out[i] = bool(out[i])
    return out
