"""`loraq api`: the API's HTTP server, uvicorn with what one connection may cost bounded.

`loraq up` and the API image (docker/api-entrypoint.sh) both start the API through `serve`, so
the limits live here and nowhere else. They come from the settings (service/settings.py):

- **Request head size.** The bytes of a request's line and headers are counted as they arrive,
  before the parser buffers them: past `max_request_head_bytes` (64 KiB) in all, or one header
  past `max_header_bytes` (16 KiB), the answer is 431 and the connection closes. A 100 MB header
  costs the process one read buffer, not 100 MB.
- **Timeouts.** A request's head must arrive within `header_timeout_seconds` of its first byte
  (of the connection's opening, for the first request): a connection that never sends a byte is
  closed then, one that sent part of a head gets 408. A body that stalls for
  `body_idle_timeout_seconds` is cut off: the route sees the client gone and logs one line
  (service/errors.py). A kept-alive connection idle for `keep_alive_timeout_seconds` between
  requests is closed (uvicorn's own keep-alive timeout).
- **Connections.** At most `connection_cap()` connections are open at once per process:
  `max_connections`, and never more than half the file-descriptor limit, which `serve` raises to
  its hard limit first. One over the cap is answered 503 (`Retry-After: 1`) at once and closed.

A refused request is closed the way HTTP servers close on a client still sending ("lingering
close"): the answer is written, the write side shut, and what the client still sends is read and
dropped for up to `LINGER_SECONDS`, so the client reads the answer instead of a reset. (A
connection over the cap has sent nothing yet: it is closed as soon as its 503 is written.)

This is a subclass of uvicorn's httptools protocol (`BoundedHttpProtocol`), passed as uvicorn's
`http` class; uvicorn's own `limit_concurrency` is not used (it counts idle connections only once
they send a request, and holds their descriptors meanwhile).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from asyncio import AbstractEventLoop, Transport
from asyncio.events import TimerHandle
from dataclasses import dataclass
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from service.api.security_headers import RAW_DEFAULTS
from service.errors import DISCONNECT_REASON, error_body
from service.settings import Settings, get_settings

log = logging.getLogger("loraq.api.connections")

LINGER_SECONDS = 2.0
GRACEFUL_SHUTDOWN_SECONDS = 5  # requests in flight get this long after SIGTERM
REFUSAL_LOG_EVERY_SECONDS = 10.0  # at most one log line per kind of refusal this often


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int
    max_head_bytes: int
    header_timeout: float
    body_idle_timeout: float
    max_connections: int


def raise_nofile_limit() -> int:
    """Raise this process's soft descriptor limit to its hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(settings: Settings) -> int:
    """Connections one API process holds at once: `max_connections`, and at most half of the
    descriptor limit (the rest is for the database, Redis, files and the reaper)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, min(settings.max_connections, soft // 2))


def limits_of(settings: Settings) -> Limits:
    return Limits(
        max_header_bytes=settings.max_header_bytes,
        max_head_bytes=settings.max_request_head_bytes,
        header_timeout=settings.header_timeout_seconds,
        body_idle_timeout=settings.body_idle_timeout_seconds,
        max_connections=connection_cap(settings),
    )


class RefusalLog:
    """One warning line per kind of refusal at most every `REFUSAL_LOG_EVERY_SECONDS`, with the
    count since the last line: a flood of refused connections is a few lines, not one each."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def note(self, kind: str, detail: str) -> None:
        self._count[kind] = self._count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last.get(kind, -REFUSAL_LOG_EVERY_SECONDS) < REFUSAL_LOG_EVERY_SECONDS:
            return
        count = self._count.pop(kind)
        self._last[kind] = now
        log.warning("%s: %s (%d since the last such line)", kind, detail, count)


refusals = RefusalLog()


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module docstring."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits_of(get_settings())
        self.head_bytes = 0  # of the request whose head is arriving
        self.in_head = True  # waiting for (the rest of) a request's line and headers
        self.heads_done = 0
        self.refused = False  # answered 4xx/503 from here: what follows is read and dropped
        self.head_timer: TimerHandle | None = None
        self.body_timer: TimerHandle | None = None
        self.last_read = 0.0

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.connections.discard(self)  # not counted against the cap while it lingers
            refusals.note("connection refused", f"{self.limits.max_connections} connections open (the cap)")
            # closed at once (nothing to drain yet): a flood costs no descriptors past the cap
            self.refuse(503, "server_busy", "too many connections; retry shortly", retry_after=1, linger=0)
            return
        self.arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # lingering close: drop it
        self.last_read = self.loop.time()
        if not self.in_head:
            super().data_received(data)
            return
        if self.head_timer is None:
            self.arm_head_timer()
        room = self.limits.max_head_bytes - self.head_bytes
        if len(data) <= room:
            self.head_bytes += len(data)
            super().data_received(data)
            return
        # Only what the limit allows goes to the parser; the head must end within it.
        heads_before = self.heads_done
        self.head_bytes += room
        super().data_received(data[:room])
        if self.refused or self.transport.is_closing():
            return
        if self.heads_done == heads_before:
            self.refuse_head(f"the request line and headers exceed {self.limits.max_head_bytes} bytes")
            return
        self.data_received(data[room:])

    # -- parser callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.refused:
            return
        if len(name) + len(value) > self.limits.max_header_bytes:
            header = name.decode("latin-1")[:64]
            self.refuse_head(f"header {header!r} exceeds {self.limits.max_header_bytes} bytes")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        self.in_head = False
        self.head_bytes = 0
        self.heads_done += 1
        self.cancel_head_timer()
        super().on_headers_complete()
        self.body_timer = self.loop.call_later(self.limits.body_idle_timeout, self.on_body_idle)

    def on_body(self, body: bytes) -> None:
        if not self.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        super().on_message_complete()
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None
        self.in_head = True  # the next request's head, if any, is counted from its first byte

    # -- timers ----------------------------------------------------------------------------
    def arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout, self.on_head_timeout)

    def cancel_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def cancel_timers(self) -> None:
        self.cancel_head_timer()
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def on_head_timeout(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.refused:
            return
        if self.head_bytes == 0:  # nothing sent (a fresh or kept-alive connection): just close
            self.transport.close()
            return
        why = f"the request head did not arrive within {self.limits.header_timeout:g}s"
        refusals.note("request timeout", why)
        self.refuse(408, "request_timeout", why)

    def on_body_idle(self) -> None:
        self.body_timer = None
        timeout = self.limits.body_idle_timeout
        if self.transport.is_closing() or self.cycle is None or not self.cycle.more_body:
            return
        now = self.loop.time()
        if self.flow.read_paused:  # the route has not taken the body so far: not the client's stall
            self.last_read = now
        idle = now - self.last_read
        if idle < timeout:
            self.body_timer = self.loop.call_later(timeout - idle, self.on_body_idle)
            return
        # The route reading the body gets `http.disconnect` and logs one line with this reason.
        self.cycle.scope.setdefault("state", {})[DISCONNECT_REASON] = f"no body bytes for {timeout:g}s"
        self.transport.close()

    # -- refusing --------------------------------------------------------------------------
    def refuse_head(self, why: str) -> None:
        refusals.note("request header too large", why)
        self.refuse(431, "request_header_too_large", why)

    def refuse(
        self,
        status: int,
        code: str,
        message: str,
        retry_after: int | None = None,
        linger: float = LINGER_SECONDS,
    ) -> None:
        """Answer `status` with OpenAI's error body (unless a response of this connection is being
        written), shut the write side, drop what the client still sends, close after the linger."""
        self.refused = True
        self.cancel_timers()
        if self.cycle is None or self.cycle.response_complete:
            kind = "invalid_request_error" if status < 500 else "server_error"
            body = json.dumps(error_body(message, kind, None, code)).encode()
            headers = [
                *self.server_state.default_headers,
                *RAW_DEFAULTS,
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            if retry_after is not None:
                headers.append((b"retry-after", str(retry_after).encode()))
            head = b"".join(name + b": " + value + b"\r\n" for name, value in headers)
            self.transport.write(STATUS_LINE[status] + head + b"\r\n" + body)
        if not linger:
            self.transport.close()  # after the answer is written
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(linger, self.transport.close)


def serve(settings: Settings) -> None:
    """Run the API (`service.app:create_app`) under uvicorn with the limits above, in the
    foreground, with `api_workers` processes; returns when it stops (SIGINT/SIGTERM)."""
    import uvicorn

    nofile = raise_nofile_limit()
    cap = connection_cap(settings)
    if cap < settings.max_connections:
        log.warning(
            "max_connections %d is over half the descriptor limit %d: capped at %d per process",
            settings.max_connections,
            nofile,
            cap,
        )
    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=settings.host,
        port=settings.port,
        workers=settings.api_workers,
        http="service.api_server:BoundedHttpProtocol",
        ws="none",
        timeout_keep_alive=settings.keep_alive_timeout_seconds,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        proxy_headers=True,
        forwarded_allow_ips=settings.forwarded_allow_ips,
        access_log=False,
    )
