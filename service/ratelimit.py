"""Per-API-key request rate limit: a fixed one-minute window counted in Redis.

Every authenticated request counts in `loraq:rl:<key id>:<minute>` (the key id is a prefix of
the key's HMAC digest, never the key), and the window's first request also sets the counter to
expire after the window (`INCR_WITH_EXPIRY`, one Lua script). Once the count passes
`rate_limit_per_minute` the request is refused with 429 and `Retry-After` (seconds until the
window ends). A fixed window lets a client send up to twice the limit across a window
boundary; the count is shared by every API process.

The round trip is awaited on the event loop (redis.asyncio), not on a worker thread: a thread
handoff per request costs more API CPU than the round trip itself. The requests that reach the
limiter while a round trip is under way share the next one (`WindowCounts`): one write, one
INCRBY per counter, and each request gets the count it would have got alone. Under load that is
one round trip for several requests (the client's work per round trip was a quarter of the
API's CPU per status read); alone, a request waits for no one.

The limit fails open: when Redis cannot be reached requests go through (the database is the
source of truth, and an unreachable Redis must not take the API down with it), and the limiter
stays off for `BREAKER_SECONDS` instead of paying a connect timeout on every request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from service.errors import RateLimitError
from service.settings import Settings, get_settings

log = logging.getLogger("loraq.api")

WINDOW_SECONDS = 60
REDIS_TIMEOUT_S = 0.25
BREAKER_SECONDS = 5.0

# INCRBY and, for a window's first requests, EXPIRE: atomic (no counter is left without an
# expiry). EVAL rather than EVALSHA: Redis caches the compiled script either way, and EVAL needs
# no reload after a Redis restart.
INCR_WITH_EXPIRY = """
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n == tonumber(ARGV[1]) then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return n
"""

_broken_until = 0.0


class WindowCounts:
    """Counts requests in Redis counters for one event loop, on one connection of its own: one
    round trip at a time, each carrying every request that came in since the previous one.
    Its commands are written and its replies read on the connection directly, without redis-py's
    pipeline object around them (measured: 99 vs 158 µs of client CPU for three counters)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.conn: Any = None  # a redis.asyncio Connection, opened on first use
        self.pending: dict[str, list[asyncio.Future[int]]] = {}
        self.sender: asyncio.Task[None] | None = None

    def add(self, counter: str) -> asyncio.Future[int]:
        """The count `counter` reaches with this request (1: its window's first)."""
        loop = asyncio.get_running_loop()
        if self.sender is None:  # it starts next iteration, once this one's requests are in
            self.sender = loop.create_task(self._send_pending())
        waiter: asyncio.Future[int] = loop.create_future()
        self.pending.setdefault(counter, []).append(waiter)
        return waiter

    async def _send_pending(self) -> None:
        try:
            while self.pending:
                batch, self.pending = self.pending, {}
                await self._send(batch)
        finally:
            self.sender = None

    async def _send(self, batch: dict[str, list[asyncio.Future[int]]]) -> None:
        commands = [
            ("EVAL", INCR_WITH_EXPIRY, 1, counter, len(waiters), WINDOW_SECONDS + 5)
            for counter, waiters in batch.items()
        ]
        try:
            if self.conn is None:
                self.conn = self.client.connection_pool.make_connection()
            await self.conn.send_packed_command(self.conn.pack_commands(commands))
            totals = [await self.conn.read_response() for _ in commands]
        except BaseException as exc:
            # Replies may now be out of step with requests: the connection is not reused. The
            # requests waiting for the next round trip fail with this one, at once: the breaker
            # (`check_rate`) lets them through instead of a second timeout.
            conn, self.conn = self.conn, None
            if conn is not None:
                await conn.disconnect(nowait=True)
            waiting = [w for waiters in (*batch.values(), *self.pending.values()) for w in waiters]
            self.pending = {}
            for waiter in waiting:
                if waiter.done():
                    continue
                if isinstance(exc, Exception):
                    waiter.set_exception(exc)
                else:  # cancelled (the loop is closing): nobody waits for ever
                    waiter.cancel()
            if not isinstance(exc, Exception):
                raise
            return
        for waiters, total in zip(batch.values(), totals, strict=True):
            first = int(total) - len(waiters) + 1
            for i, waiter in enumerate(waiters):
                if not waiter.done():
                    waiter.set_result(first + i)


# An asyncio connection belongs to the event loop that opened it: one client (and its counts)
# per loop and URL. uvicorn runs one loop per process; tests run one after another (entries of
# closed loops are dropped when a new loop arrives).
_counts: dict[asyncio.AbstractEventLoop, dict[str, WindowCounts]] = {}


def now() -> float:
    return time.time()


def _window_counts(settings: Settings) -> WindowCounts:
    """This event loop's counts on the settings' Redis."""
    from service.redis_client import async_redis_client

    url = settings.resolved_redis_url
    loop = asyncio.get_running_loop()
    per_loop = _counts.get(loop)
    if per_loop is None:
        for old in list(_counts):
            if old.is_closed():
                _counts.pop(old, None)
        per_loop = _counts[loop] = {}
    if url not in per_loop:
        client = async_redis_client(settings, socket_timeout=REDIS_TIMEOUT_S, connect_timeout=REDIS_TIMEOUT_S)
        per_loop[url] = WindowCounts(client)
    return per_loop[url]


async def check_rate(key_id: str) -> None:
    """Count one request of API key `key_id`; RateLimitError (429, Retry-After) past the limit."""
    global _broken_until
    settings = get_settings()
    limit = settings.rate_limit_per_minute
    t = now()
    if limit <= 0 or t < _broken_until:
        return
    import redis

    window = int(t // WINDOW_SECONDS)
    try:
        count = await _window_counts(settings).add(f"loraq:rl:{key_id}:{window}")
    except redis.exceptions.RedisError:
        _broken_until = t + BREAKER_SECONDS
        log.warning("rate limit: Redis unreachable; not limiting for %.0fs", BREAKER_SECONDS, exc_info=True)
        return
    if count > limit:
        retry_after = max(1, math.ceil((window + 1) * WINDOW_SECONDS - t))
        raise RateLimitError(
            f"Rate limit reached: this API key may make {limit} requests per minute; "
            f"retry after {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )
