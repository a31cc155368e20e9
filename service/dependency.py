"""Riding out a dependency's outage (Redis stalled, restarting or reloading its append-only file).

A long-running process that needs Redis (the inference worker's loop, the Celery worker's registry
beat and consumer watch) keeps one `DependencyHealth` per dependency: every failed call says how
long to wait before the next try (exponential backoff, capped), and `may_try()` is False until
then, so a call that is optional (a registry write from the training loop) skips Redis instead of
waiting out a timeout per call. The first failure of an outage is logged once (not one traceback
per retry), and the first success after it says how long it lasted. `up` is what the process
reports on its `/metrics` (`loraq_redis_up`).

A process that gives up on a dependency anyway (the Celery worker whose consumer stopped taking
messages) exits with `EXIT_DEPENDENCY_DOWN`: `loraq up` restarts it without counting the exit
towards its crash-loop rule (service/supervisor.py).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service.settings import Settings

# sysexits.h EX_TEMPFAIL: "a temporary failure; the user is invited to retry".
EXIT_DEPENDENCY_DOWN = 75
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0  # a service is back at most this long after its Redis


class DependencyHealth:
    """Up/down state, backoff and outage logging of one dependency, shared by a process's threads."""

    def __init__(
        self,
        name: str,
        log: logging.Logger,
        *,
        first: float = BACKOFF_FIRST_S,
        most: float = BACKOFF_MAX_S,
    ) -> None:
        self.name = name
        self.log = log
        self.first, self.most = first, most
        self._lock = threading.Lock()
        self._delay = first
        self._down_since: float | None = None  # monotonic time of the outage's first failure
        self._retry_at = 0.0  # monotonic time from which the next try is due

    @property
    def up(self) -> bool:
        return self._down_since is None

    def may_try(self) -> bool:
        """True while up, and during an outage once the backoff since the last failure is over."""
        return self._down_since is None or time.monotonic() >= self._retry_at

    def down_for(self) -> float:
        """Seconds since the outage began (0 while up)."""
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since

    def failed(self, exc: BaseException) -> float:
        """Record a failed call; return how many seconds to wait before the next try."""
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()
                self._delay = self.first
                self.log.warning(
                    "%s unreachable (%s: %s); retrying with backoff up to %gs",
                    self.name, type(exc).__name__, exc, self.most,
                )  # fmt: skip
            delay = self._delay
            self._delay = min(self._delay * 2, self.most)
            self._retry_at = time.monotonic() + delay
            return delay

    def ok(self) -> None:
        """Record a successful call (after an outage: say that it ended, and how long it lasted)."""
        if self._down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._down_since is not None:
                self.log.warning("%s answers again after %.1fs", self.name, self.down_for())
                self._down_since = None
                self._delay = self.first


def redis_down(settings: Settings) -> str | None:
    """None when the broker's Redis answers PING within the settings' timeouts; else why not."""
    import redis

    from service.redis_client import redis_client

    try:
        client = redis_client(settings)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError) as e:  # ValueError: a malformed LORAQ_REDIS_URL
        return type(e).__name__
    return None


def database_down(url: str | None = None) -> str | None:
    """None when the database (default: the settings') answers `SELECT 1`; else why not."""
    from sqlalchemy import text

    from service.db.session import get_engine

    try:
        with get_engine(url).connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:
        return type(e).__name__
    return None
