"""Security headers on every response of the API: `/v1`, `/dashboard/api`, `/docs`, `/redoc`,
`/static`, `/metrics`, errors included.

A response gets each header of `DEFAULT_HEADERS` that it does not set itself: no MIME sniffing,
no framing by another page (`X-Frame-Options` for old browsers, CSP `frame-ancestors` for the
rest), no referrer to other origins, and a CSP that lets a JSON answer or an asset load nothing.
Pages set their own CSP: the dashboard's (service/api/dashboard.py) and the docs' (`DOCS_CSP`,
service/api/docs.py).

`SecureHeadersApp` adds them outside Starlette's ServerErrorMiddleware, so a 500 carries them too.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "same-origin",
}
# Swagger UI and ReDoc: same-origin scripts only (ours start them from static files), inline
# styles (ReDoc writes <style> elements), ReDoc's search worker from a blob: URL, data: images.
DOCS_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "worker-src 'self' blob:; connect-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
RAW_DEFAULTS = [(name.lower().encode(), value.encode()) for name, value in DEFAULT_HEADERS.items()]


class SecurityHeaders:
    """ASGI middleware: each default header the response lacks is added to its start message."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(n, v) for n, v in RAW_DEFAULTS if n not in present]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)


class SecureHeadersApp(FastAPI):
    """FastAPI with `SecurityHeaders` around its whole middleware stack."""

    def build_middleware_stack(self) -> ASGIApp:
        return SecurityHeaders(super().build_middleware_stack())
