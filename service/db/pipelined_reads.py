"""`PipelinedReads`: PostgreSQL's hot-path reads (`session.read_first`) on one libpq connection
per event loop in pipeline mode, and the per-loop registry of those connections."""

from __future__ import annotations

import asyncio
import weakref
from collections import deque, namedtuple
from dataclasses import dataclass
from typing import Any

PG_CONNECT_TIMEOUT_S = 5


@dataclass
class Compiled:
    """A hot-path statement as its dialect writes it, parameters bound in `positions` order
    (SQLite's `?`, libpq's `$1`...); `row` is its row type once a read has seen the columns."""

    sql: str
    positions: tuple[str, ...]
    row: type[tuple[Any, ...]] | None = None


class PipelinedReads:
    """PostgreSQL reads on one psycopg connection per event loop, in libpq's pipeline mode.

    The reads started in one loop iteration go to the server in one write; the results come
    back in order on a reader callback that stays registered with the loop, and each read's
    future gets its row. Under load one write and one wake-up serve several status
    reads, and nothing of psycopg's per-query machinery (its cursor, generators and waits) runs:
    measured on the 2-core dev box, psycopg's cursor cost 66-89 µs of API CPU per read, this
    about 20-40 µs, SQLite's inline read 19 µs.

    - autocommit: each SELECT is its own transaction, no ROLLBACK round trip.
    - Statements are prepared on first use on the connection (parsed and planned once), with
      the parameter types of that first use, as psycopg does.
    - Parameters are dumped and rows loaded by psycopg's Transformer on the connection's
      adapters; json and jsonb load as their text, as SQLite gives them (`read_first`).
    - No ping before use: a connection that fails is closed and its reads fail; the next read
      opens a new one. A query that fails fails its own read, not the connection.
    - One connection: the reads are indexed single-row lookups, served one after another by
      one server process.
    """

    def __init__(self, url: str) -> None:
        from sqlalchemy.engine import make_url

        self.dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn: Any = None  # psycopg.AsyncConnection, once open
        self.connecting: asyncio.Task[None] | None = None
        self.tx: Any = None  # psycopg Transformer of `conn`
        self.fd = -1  # `conn`'s socket
        self.prepared: dict[tuple[str, tuple[int, ...]], bytes] = {}  # (SQL, types) -> name
        self.statements = 0  # statements named on this connection
        # Reads not sent yet: (compiled statement, parameter values, future)
        self.queued: list[tuple[Compiled, list[Any], asyncio.Future[Any]]] = []
        # What the server answers next, in order: ("read", statement, future), ("prepare",
        # key in `prepared`, None) or ("sync", None, None)
        self.expected: deque[tuple[str, Any, asyncio.Future[Any] | None]] = deque()
        self.result: Any = None  # the current query's result, until its end (None) arrives
        self.prepare_error: Exception | None = None  # why the read being skipped failed

    def first(self, compiled: Compiled, params: dict[str, Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        if not self.queued:  # sent next iteration, with the reads this one starts after it
            loop.call_soon(self._send)
        row: asyncio.Future[Any] = loop.create_future()
        self.queued.append((compiled, [params[name] for name in compiled.positions], row))
        return row

    def _send(self) -> None:
        if not self.queued:
            return
        if self.conn is None:
            if self.connecting is None:
                self.connecting = asyncio.get_running_loop().create_task(self._connect())
            return  # `_connect` sends what is queued
        from psycopg.adapt import PyFormat

        queued, self.queued = self.queued, []
        pgconn = self.conn.pgconn
        try:
            for compiled, values, row in queued:
                try:
                    dumped = self.tx.dump_sequence(values, [PyFormat.TEXT] * len(values))
                except Exception as exc:  # a value PostgreSQL cannot hold: this read's error
                    if not row.done():
                        row.set_exception(exc)
                    continue
                types = tuple(self.tx.types or ())
                name = self.prepared.get((compiled.sql, types))
                if name is None:
                    self.statements += 1  # not len(prepared), which a failed prepare shrinks
                    name = self.prepared[(compiled.sql, types)] = f"loraq_{self.statements}".encode()
                    pgconn.send_prepare(name, compiled.sql.encode(), types)
                    self.expected.append(("prepare", (compiled.sql, types), None))
                pgconn.send_query_prepared(name, dumped)
                self.expected.append(("read", compiled, row))
                # A sync per read: a read that fails (its prepare included) makes the server
                # skip the rest of its sync group only, never another request's read.
                pgconn.pipeline_sync()
                self.expected.append(("sync", None, None))
            self._flush()
        except Exception as exc:
            self._fail(exc, [row for _, _, row in queued])

    def _flush(self) -> None:
        """Write what libpq holds; what the socket does not take now goes when it is writable."""
        try:
            pending = self.conn.pgconn.flush()
        except Exception as exc:
            self._fail(exc)
            return
        loop = asyncio.get_running_loop()
        if pending:
            loop.add_writer(self.fd, self._flush)
        else:
            loop.remove_writer(self.fd)

    async def _connect(self) -> None:
        import psycopg
        from psycopg.adapt import Transformer
        from psycopg.types.string import TextLoader

        try:
            conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, connect_timeout=PG_CONNECT_TIMEOUT_S
            )
        except Exception as exc:
            self.connecting = None
            self._fail(exc)
            return
        for json_type in ("json", "jsonb"):
            conn.adapters.register_loader(json_type, TextLoader)
        conn.pgconn.nonblocking = 1
        conn.pgconn.enter_pipeline_mode()
        self.conn, self.tx, self.connecting = conn, Transformer(conn), None
        self.fd = conn.pgconn.socket  # kept: a lost connection has no socket to ask for
        asyncio.get_running_loop().add_reader(self.fd, self._on_readable)
        if self.queued:
            self._send()

    def _on_readable(self) -> None:
        from psycopg import pq

        pgconn = self.conn.pgconn
        try:
            pgconn.consume_input()
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    if self.result is None:
                        break  # nothing more for now
                    self._resolve(self.expected.popleft(), self.result)
                    self.result = None
                elif result.status == pq.ExecStatus.PIPELINE_SYNC:
                    self.expected.popleft()
                else:
                    self.result = result
        except Exception as exc:  # the connection is lost: its reads fail, the next reconnects
            self._fail(exc)

    def _resolve(self, expected: tuple[str, Any, asyncio.Future[Any] | None], result: Any) -> None:
        from psycopg import errors, pq

        kind, what, row = expected
        if kind == "prepare":  # a failure fails the read after it too, which the server skips
            if result.status != pq.ExecStatus.COMMAND_OK:
                self.prepared.pop(what, None)
                self.prepare_error = errors.error_from_result(result, encoding=self.conn.info.encoding)
            return
        prepare_error, self.prepare_error = self.prepare_error, None
        if row is None or row.done():  # its request is gone (cancelled)
            return
        if result.status == pq.ExecStatus.TUPLES_OK:
            compiled: Compiled = what
            if compiled.row is None:  # named by the result's column names, as SQLite's rows are
                names = [result.fname(i).decode() for i in range(result.nfields)]
                compiled.row = namedtuple("Row", names, rename=True)  # type: ignore[misc]
            self.tx.set_pgresult(result)
            values = self.tx.load_row(0, tuple) if result.ntuples else None
            row.set_result(None if values is None else compiled.row._make(values))  # type: ignore[attr-defined]
        elif result.status == pq.ExecStatus.PIPELINE_ABORTED:
            row.set_exception(prepare_error or errors.PipelineAborted("its statement failed"))
        else:
            row.set_exception(errors.error_from_result(result, encoding=self.conn.info.encoding))

    def _fail(self, exc: Exception, also: list[asyncio.Future[Any]] | None = None) -> None:
        """Fail every read waiting on this connection and close it; the next read reconnects."""
        waiting = [*(also or []), *(row for _, _, row in self.queued)]
        waiting += [row for _, _, row in self.expected if row is not None]
        self.queued, self.expected, self.result, self.prepared, self.statements = [], deque(), None, {}, 0
        for row in waiting:
            if not row.done():
                row.set_exception(exc)
        conn, self.conn = self.conn, None
        if conn is not None:
            loop = asyncio.get_running_loop()
            loop.remove_reader(self.fd)
            loop.remove_writer(self.fd)
            conn.pgconn.finish()

    async def close(self) -> None:
        from psycopg import errors

        self._fail(errors.OperationalError("the read connection was closed"))


# Async connections belong to the event loop they were opened on: one per loop (the API has one;
# each test client has its own), dropped with the loop.
_read_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, PipelinedReads]] = (
    weakref.WeakKeyDictionary()
)


def read_pool(url: str) -> PipelinedReads:
    per_loop = _read_pools.get(asyncio.get_running_loop())
    if per_loop is None:
        per_loop = _read_pools[asyncio.get_running_loop()] = {}
    if url not in per_loop:
        per_loop[url] = PipelinedReads(url)
    return per_loop[url]


async def close_read_pools() -> None:
    """Close the running loop's read connections (the app's shutdown)."""
    for pool in _read_pools.pop(asyncio.get_running_loop(), {}).values():
        await pool.close()


def forget_read_pools() -> None:
    """Drop every loop's read connections without closing them: another loop's connections cannot
    be closed from here (they close when collected; DROP DATABASE ... WITH (FORCE) ends them
    server-side)."""
    _read_pools.clear()
