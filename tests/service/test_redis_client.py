"""Every Redis client comes from service.redis_client: the broker's URL (or its default) and the
settings' timeouts, which a caller that blocks on purpose may lengthen."""

from __future__ import annotations

from typing import Any

from service.redis_client import async_redis_client, redis_client
from service.settings import DEFAULT_REDIS_URL, Settings


def options(client: Any) -> dict[str, Any]:
    return dict(client.connection_pool.connection_kwargs)


def test_clients_use_the_settings_url_and_timeouts() -> None:
    settings = Settings(
        redis_url="redis://example:6390/2",
        redis_socket_timeout_seconds=0.7,
        redis_connect_timeout_seconds=0.3,
    )
    for client in (redis_client(settings), async_redis_client(settings)):
        kw = options(client)
        assert (kw["host"], kw["port"], kw["db"]) == ("example", 6390, 2)
        assert (kw["socket_timeout"], kw["socket_connect_timeout"]) == (0.7, 0.3)
    blocking = options(redis_client(settings, socket_timeout=5.0))
    assert (blocking["socket_timeout"], blocking["socket_connect_timeout"]) == (5.0, 0.3)
    other = options(redis_client(settings, url="redis://127.0.0.1:7000/0", connect_timeout=0.1))
    assert (other["port"], other["socket_timeout"], other["socket_connect_timeout"]) == (7000, 0.7, 0.1)


def test_unset_url_is_the_one_default() -> None:
    settings = Settings(redis_url=None)
    assert settings.resolved_redis_url == DEFAULT_REDIS_URL == "redis://127.0.0.1:6379/0"
    kw = options(redis_client(settings))
    assert (kw["host"], kw["port"], kw["db"]) == ("127.0.0.1", 6379, 0)
