"""One error hierarchy for the control plane, rendered as OpenAI's error body:

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Service modules raise `LoraqError` subclasses; `install_error_handlers` maps them, FastAPI's
request validation errors (→ 400 naming the parameter), Starlette's HTTP errors (unknown
route → 404, wrong method → 405) and the failures of what the service depends on
(`dependency_error`: the database unreachable → 503 with Retry-After, a full disk → 507) to that
body in one place.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import sys
from typing import Any

import sqlalchemy.exc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Mount

log = logging.getLogger("loraq.api")

# scope["state"] key: why the server cut a request body off (service/api_server.py sets it)
DISCONNECT_REASON = "loraq.disconnect_reason"


class LoraqError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}


class InvalidRequestError(LoraqError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationError(LoraqError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFoundError(LoraqError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ConflictError(LoraqError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLargeError(LoraqError):
    status = 413
    type = "invalid_request_error"
    code = "file_too_large"


class RateLimitError(LoraqError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class StorageError(LoraqError):
    """The store lost or corrupted an object (sha256 mismatch, missing file)."""

    status = 500
    type = "server_error"
    code = "storage_error"


class UnavailableError(LoraqError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class DatabaseUnavailableError(UnavailableError):
    """The database did not answer: stopped, restarting, unreachable, or out of connections."""

    code = "database_unavailable"


class InsufficientStorageError(LoraqError):
    """A write found its disk full (ENOSPC or a quota; SQLite's or PostgreSQL's disk full)."""

    status = 507
    type = "server_error"
    code = "disk_full"


# What a 503 for the database tells a client to wait, in seconds: about a PostgreSQL restart, and
# the connect timeout an unreachable server costs each request anyway.
DATABASE_RETRY_AFTER_S = 5
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# SQLite result codes (the primary code, the low byte) of a database file that cannot be used for
# now: locked past the busy timeout, an I/O error, a file that cannot be opened.
SQLITE_UNAVAILABLE = frozenset(
    {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN}
)
# SQLSTATE classes of a PostgreSQL server that cannot serve now: 08 connection exception, 40
# transaction rollback (deadlock, serialization), 53 insufficient resources (too many connections),
# 55 lock not available, 57 operator intervention (shutting down, starting up), 58 system error.
PG_UNAVAILABLE_CLASSES = frozenset({"08", "40", "53", "55", "57", "58"})
PG_DISK_FULL = "53100"


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and what it was raised from or while handling: a SQLAlchemy error's driver error,
    torch's RuntimeError around the OSError of a failed write."""
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain and len(chain) < 8:
        chain.append(e)
        # `raise ... from cause` names its cause (`from None`: nothing); else what was being handled
        explicit = e.__cause__ is not None or e.__suppress_context__
        e = e.__cause__ if explicit else e.__context__
    return chain


def _sqlstate(exc: BaseException) -> str | None:
    psycopg = sys.modules.get("psycopg")  # not imported: the error cannot be one of its
    return exc.sqlstate if psycopg is not None and isinstance(exc, psycopg.Error) else None


def is_disk_full(exc: BaseException) -> bool:
    """Did `exc` come from a write that found its disk full?"""
    for e in _chain(exc):
        if isinstance(e, InsufficientStorageError):
            return True
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if isinstance(e, sqlite3.Error) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            return True
        if _sqlstate(e) == PG_DISK_FULL:
            return True
    return False


def is_database_unavailable(exc: BaseException) -> bool:
    """Did `exc` come from a database that cannot serve for now (rather than from a bad query)?"""
    psycopg = sys.modules.get("psycopg")
    for e in _chain(exc):
        if isinstance(e, sqlalchemy.exc.TimeoutError):  # no pooled connection came free in time
            return True
        if isinstance(e, sqlite3.OperationalError):
            return (getattr(e, "sqlite_errorcode", 0) & 0xFF) in SQLITE_UNAVAILABLE
        if psycopg is not None and isinstance(e, psycopg.InterfaceError):  # a closed connection
            return True
        if psycopg is not None and isinstance(e, psycopg.OperationalError):
            state = _sqlstate(e)  # None: no server answered (refused, timed out, connection lost)
            return state is None or state[:2] in PG_UNAVAILABLE_CLASSES
    return False


def dependency_error(exc: BaseException) -> LoraqError | None:
    """What a failure of the database or the disk answers, or None for any other error (a bug)."""
    if is_disk_full(exc):
        return InsufficientStorageError(
            "the server's storage is full, so nothing was stored: retry once space has been freed"
        )
    if is_database_unavailable(exc):
        return DatabaseUnavailableError(
            f"the database is unavailable; retry in {DATABASE_RETRY_AFTER_S} s",
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        )
    return None


def dependency_error_types() -> tuple[type[Exception], ...]:
    """The exception classes `dependency_error` may map: each gets the handler that asks it."""
    import psycopg

    return (
        OSError,
        sqlite3.OperationalError,
        sqlalchemy.exc.OperationalError,
        sqlalchemy.exc.InterfaceError,
        sqlalchemy.exc.TimeoutError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )


def error_body(message: str, type_: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: LoraqError) -> JSONResponse:
    headers = dict(exc.headers)
    if exc.status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return JSONResponse(
        error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status, headers=headers
    )


def _param_of(loc: tuple[Any, ...]) -> str:
    """("body", "hyperparameters", "n_epochs") -> "hyperparameters.n_epochs"; ("query", "limit") -> "limit".

    Pydantic appends union-branch tags ("list[constrained-str]", "literal['all-linear']") to the
    location; the parameter ends before the first of them.
    """
    parts: list[str] = []
    for p in loc[1:]:
        if isinstance(p, int):
            parts.append(f"[{p}]")
            continue
        text = str(p)
        if any(c in text for c in "[-'("):
            break
        parts.append(text)
    return ".".join(parts).replace(".[", "[") or str(loc[0] if loc else "body")


def invalid_json(reason: str) -> LoraqError:
    message = f"the request body is not valid JSON: {reason}"
    return InvalidRequestError(message, param="body", code="invalid_json")


def validation_error(exc: RequestValidationError) -> LoraqError:
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":  # FastAPI's json.loads failed: loc is ("body", offset)
        offset = first.get("loc", ("body", "?"))[-1]
        return invalid_json(f"{first.get('ctx', {}).get('error', 'malformed')} at byte {offset}")
    param = _param_of(tuple(first.get("loc", ())))
    reason = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    message = f"invalid value for '{param}': {reason}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return InvalidRequestError(message, param=param, code="invalid_value")


# FastAPI's 400 when reading a JSON body raised anything but a JSONDecodeError (RecursionError for
# deep nesting, ValueError for an integer of more than 4,300 digits); the cause is chained to it.
BODY_PARSE_ERROR = "There was an error parsing the body"

HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
STATIC_METHODS = ["GET", "HEAD"]  # the one mount: the dashboard's static files


def allowed_methods(request: Request) -> list[str]:
    """Every method some route serves at this path (Starlette's own 405 names only the methods of
    the first route whose path matched, e.g. GET but not POST for /v1/files): each method is
    tried against the app's routes, as routing would."""
    routes = [r for r in request.app.router.routes if not isinstance(r, Mount)]
    allowed = [
        method
        for method in HTTP_METHODS
        if any(r.matches({**request.scope, "method": method})[0] == Match.FULL for r in routes)
    ]
    return allowed or STATIC_METHODS


def install_error_handlers(app: FastAPI) -> None:
    async def on_loraq_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, LoraqError)
        if exc.status >= 500:
            log.error("%s: %s", type(exc).__name__, exc.message)
        return error_response(exc)

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: LoraqError = NotFoundError("unknown URL; see /docs for the API", code="unknown_url")
        elif exc.status_code == 405:
            allowed = allowed_methods(request)
            err = InvalidRequestError(
                f"method {request.method} not allowed for this URL; allowed: {', '.join(allowed)}",
                code="method_not_allowed",
            )
            err.status = 405
            err.headers = {**(exc.headers or {}), "Allow": ", ".join(allowed)}
            return error_response(err)
        elif exc.detail == BODY_PARSE_ERROR:  # json.loads raised something else than a decode error
            cause = exc.__cause__
            err = invalid_json("nested too deeply" if isinstance(cause, RecursionError) else str(cause)[:200])
        else:
            err = LoraqError(str(exc.detail))
            err.status = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
            err.code = "invalid_request" if exc.status_code < 500 else None
        err.headers = dict(exc.headers or {})
        return error_response(err)

    async def on_client_gone(request: Request, _: Exception) -> JSONResponse:
        # An upload cut off by its client, or by the server's body timeout: one line, no traceback.
        why = request.scope.get("state", {}).get(DISCONNECT_REASON, "the client disconnected")
        log.warning("%s %s: the request body ended early (%s)", request.method, request.url.path, why)
        # nobody reads this answer (the connection is gone); request metrics count it as a 400
        return error_response(
            InvalidRequestError(f"request body incomplete: {why}", code="client_disconnected")
        )

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(LoraqError("internal server error"))

    async def on_dependency_error(request: Request, exc: Exception) -> JSONResponse:
        err = dependency_error(exc)
        if err is None:
            return await on_unexpected(request, exc)
        # one line a request: an outage must not fill the log with tracebacks
        why = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        log.warning("%s %s: %s (%s: %s)", request.method, request.url.path, err.code, type(exc).__name__, why)
        return error_response(err)

    app.add_exception_handler(LoraqError, on_loraq_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    for exc_type in dependency_error_types():
        app.add_exception_handler(exc_type, on_dependency_error)
    app.add_exception_handler(Exception, on_unexpected)
