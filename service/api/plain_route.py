"""`PlainGetRoute`: a GET route served by a plain `endpoint(request) -> Response`, for a hot path
that FastAPI's per-request work would dominate.

FastAPI's route solves the endpoint's dependencies, validates its parameters and wraps the call
in exit stacks on every request: for the status read (one indexed row and one Redis round trip)
that was about a third of the API's CPU. This route does none of it. Listed before FastAPI's
route of the same path (`install_plain_routes`), it serves that path's GETs, while the FastAPI
route still documents the operation in the OpenAPI schema and answers every other method (405).

What the endpoint gets from FastAPI no more, it does itself: authentication through the same
function as `CurrentTenant`, and the app-level query guard, which this route calls. The rest is
the app's as for any route: the middlewares (request metrics see this route's template in
`scope["route"]`) and the exception handlers, which turn whatever the endpoint raises into the
same error body (service/errors.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.routing import BaseRoute, Match, NoMatchFound, compile_path, get_route_path
from starlette.types import Receive, Scope, Send

from service.api.query_guard import refuse_nul_in_query

Endpoint = Callable[[Request], Awaitable[Response]]


class PlainGetRoute(BaseRoute):
    def __init__(self, path: str, endpoint: Endpoint) -> None:
        self.path = path
        self.endpoint = endpoint
        self.path_regex, self.path_format, self.param_convertors = compile_path(path)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        # Only GET: any other method falls through to the FastAPI route, which answers it.
        if scope["type"] != "http" or scope["method"] != "GET":
            return Match.NONE, {}
        found = self.path_regex.match(get_route_path(scope))
        if found is None:
            return Match.NONE, {}
        params = {k: self.param_convertors[k].convert(v) for k, v in found.groupdict().items()}
        return Match.FULL, {"route": self, "endpoint": self.endpoint, "path_params": params}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)  # reverse lookups name the FastAPI route

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        await refuse_nul_in_query(request)
        response = await self.endpoint(request)
        await response(scope, receive, send)


def install_plain_routes(app: FastAPI, routes: list[PlainGetRoute]) -> None:
    """Put `routes` first in `app`'s routing, ahead of the FastAPI routes of their paths."""
    app.router.routes[:0] = routes
