"""Per-API-key request rate limit: a fixed one-minute window counted in Redis.

Every authenticated request does `INCR loraq:rl:<key id>:<minute>` (the key id is a prefix of
the key's HMAC digest, never the key) with the counter expiring after the window. Once the
count passes `rate_limit_per_minute` the request is refused with 429 and `Retry-After` (seconds
until the window ends). A fixed window lets a client send up to twice the limit across a window
boundary; it is one round trip per request and shared by every API process.

The limit fails open: when Redis cannot be reached requests go through (the database is the
source of truth, and an unreachable Redis must not take the API down with it), and the limiter
stays off for `BREAKER_SECONDS` instead of paying a connect timeout on every request.
"""

from __future__ import annotations

import logging
import math
import time
from functools import lru_cache
from typing import Any

from service.errors import RateLimitError
from service.settings import get_settings

log = logging.getLogger("loraq.api")

WINDOW_SECONDS = 60
REDIS_TIMEOUT_S = 0.25
BREAKER_SECONDS = 5.0

_broken_until = 0.0


def now() -> float:
    return time.time()


@lru_cache(maxsize=4)
def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S)


def check_rate(key_id: str) -> None:
    """Count one request of API key `key_id`; RateLimitError (429, Retry-After) past the limit."""
    global _broken_until
    settings = get_settings()
    limit = settings.rate_limit_per_minute
    t = now()
    if limit <= 0 or t < _broken_until:
        return
    import redis

    from worker.celery_app import broker_url

    window = int(t // WINDOW_SECONDS)
    counter = f"loraq:rl:{key_id}:{window}"
    try:
        pipe = _client(broker_url(settings)).pipeline(transaction=False)
        pipe.incr(counter)
        pipe.expire(counter, WINDOW_SECONDS + 5)
        count = int(pipe.execute()[0])
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
