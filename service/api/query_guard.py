"""Refuses a query string that carries a NUL character, naming the parameter.

PostgreSQL's text type cannot hold NUL: a filter such as `GET /v1/files?purpose=%00` would reach
the database and fail there as a 500. SQLite stores it, so the same request would answer
differently per backend. Refused for every route, before any handler runs.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

from fastapi import Request

from service.errors import InvalidRequestError


async def refuse_nul_in_query(request: Request) -> None:
    """Async: a sync dependency would cost every request a threadpool handoff."""
    raw: bytes = request.scope.get("query_string", b"")
    if b"%00" not in raw and b"\x00" not in raw:  # the common case: one scan, nothing parsed
        return
    for name, value in parse_qsl(raw.decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            param = name.replace("\x00", "\\0")
            raise InvalidRequestError(
                f"query parameter {param!r} contains a NUL character", param=param, code="invalid_query"
            )
