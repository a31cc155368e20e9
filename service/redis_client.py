"""Every Redis client of the service and the workers is built here: on the broker's Redis
(`settings.resolved_redis_url`) with the settings' connect and socket timeouts, so no Redis call
waits unbounded. A caller that blocks on purpose (BLPOP) or must fail faster passes its own
socket timeout."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio

from service.settings import Settings

# What an unreachable Redis raises (refused, reset, timed out, still loading its append-only file):
# a caller that rides out outages retries on these; any other RedisError is a bug to surface.
REDIS_OUTAGE: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _options(
    settings: Settings, socket_timeout: float | None, connect_timeout: float | None
) -> dict[str, Any]:
    options: dict[str, Any] = dict(settings.redis_timeouts)
    if socket_timeout is not None:
        options["socket_timeout"] = socket_timeout
    if connect_timeout is not None:
        options["socket_connect_timeout"] = connect_timeout
    return options


def redis_client(
    settings: Settings,
    *,
    url: str | None = None,
    socket_timeout: float | None = None,
    connect_timeout: float | None = None,
) -> redis.Redis:
    """A client of `url` (default: the broker's Redis); timeouts default to the settings'."""
    return redis.Redis.from_url(
        url or settings.resolved_redis_url, **_options(settings, socket_timeout, connect_timeout)
    )


def async_redis_client(
    settings: Settings,
    *,
    socket_timeout: float | None = None,
    connect_timeout: float | None = None,
) -> redis.asyncio.Redis:
    """The asyncio twin of `redis_client`, on the broker's Redis."""
    return redis.asyncio.Redis.from_url(
        settings.resolved_redis_url, **_options(settings, socket_timeout, connect_timeout)
    )
