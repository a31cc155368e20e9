"""One error hierarchy for the control plane, rendered as OpenAI's error body:

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Service modules raise `LoraqError` subclasses; `install_error_handlers` maps them, FastAPI's
request validation errors (→ 400 naming the parameter) and Starlette's HTTP errors (unknown
route → 404, wrong method → 405) to that body in one place.
"""

from __future__ import annotations

import logging
from typing import Any

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

    app.add_exception_handler(LoraqError, on_loraq_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(ClientDisconnect, on_client_gone)
    app.add_exception_handler(Exception, on_unexpected)
