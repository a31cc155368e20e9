"""Per-API-key request rate limit: a fixed one-minute window counted in Redis.

Every authenticated request does `INCR loraq:rl:<key id>:<minute>` (the key id is a prefix of
the key's HMAC digest, never the key), and the window's first request also sets the counter to
expire after the window (`INCR_WITH_EXPIRY`, one Lua script). Once the count passes
`rate_limit_per_minute` the request is refused with 429 and `Retry-After` (seconds until the
window ends). A fixed window lets a client send up to twice the limit across a window
boundary; it is one round trip per request and shared by every API process.

The round trip is awaited on the event loop (redis.asyncio), not on a worker thread: a thread
handoff per request costs more API CPU than the round trip itself.

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

# INCR and, for a window's first request, EXPIRE: one command, atomic (no counter is left without
# an expiry), and less client CPU than a two-command pipeline.
INCR_WITH_EXPIRY = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return n
"""

_broken_until = 0.0

# An asyncio connection belongs to the event loop that opened it: one client (and its script)
# per loop and URL. uvicorn runs one loop per process; tests run one after another (entries of
# closed loops are dropped when a new loop arrives).
_scripts: dict[asyncio.AbstractEventLoop, dict[str, Any]] = {}


def now() -> float:
    return time.time()


def _incr_script(settings: Settings) -> Any:
    """The script bound to this event loop's client for the settings' Redis."""
    from service.redis_client import async_redis_client

    url = settings.resolved_redis_url
    loop = asyncio.get_running_loop()
    per_loop = _scripts.get(loop)
    if per_loop is None:
        for old in list(_scripts):
            if old.is_closed():
                _scripts.pop(old, None)
        per_loop = _scripts[loop] = {}
    if url not in per_loop:
        client = async_redis_client(settings, socket_timeout=REDIS_TIMEOUT_S, connect_timeout=REDIS_TIMEOUT_S)
        per_loop[url] = client.register_script(INCR_WITH_EXPIRY)
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
    counter = f"loraq:rl:{key_id}:{window}"
    try:
        count = int(await _incr_script(settings)(keys=[counter], args=[WINDOW_SECONDS + 5]))
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
