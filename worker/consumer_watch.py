"""Is this Celery worker's consumer taking messages? The worker's watchdog, and what its registry
entry and `/metrics` say about it.

A worker process can stay alive, with a fresh registry heartbeat, while its consumer takes nothing
more: after a Redis stall Kombu once lost a prefetch slot to a failed acknowledgement and never
polled again (service/broker_transport.py fixes that cause; this catches any other). Polls are
Kombu's business, so the watch judges by what it can see: messages waiting in this worker's queue,
no job running here, and no message received since they were first seen waiting. Only observations
made while Redis answers count, so an outage of any length never looks like a dead consumer.

After `worker_stuck_seconds` of that, the worker stops itself, warmly (Celery's shutdown flag: the
consumer hands back what it holds), and leaves with `EXIT_DEPENDENCY_DOWN`; `loraq up` (or compose's
restart policy) starts it again without counting a crash, and the fresh consumer takes the queue.
If the warm shutdown does not end the process within `FORCE_EXIT_AFTER_S`, it exits at once.

State is per process: the last message received comes from Celery's `task_received` signal (in the
consumer: worker/celery_app.py), whether a job runs from Celery's own count of the requests this
worker holds (received and not yet done), which holds in the consumer's process whatever the pool.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from service.broker import kombu_queue_depth
from service.dependency import EXIT_DEPENDENCY_DOWN, DependencyHealth
from service.redis_client import REDIS_OUTAGE, redis_client
from service.settings import Settings, get_settings

log = logging.getLogger("loraq.worker.watch")

CHECK_SECONDS = 2.0
FORCE_EXIT_AFTER_S = 30.0


class ConsumerWatch:
    """What the watchdog knows; methods are called from Celery's signal handlers and its thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.redis = DependencyHealth("Redis (consumer watch)", log)
        self.busy = False  # this worker holds a message: a job runs (or waits for its ETA)
        self.last_received: float | None = None  # unix time of the last message the consumer took
        self.waiting_since: float | None = None  # unix time messages were first seen waiting, untaken
        self.stuck = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- Celery's signals
    def received(self) -> None:
        self.last_received = time.time()

    # -- what the registry entry and /metrics report
    @property
    def consuming(self) -> bool:
        """False from the moment messages wait untaken for `worker_stuck_seconds`."""
        return not self.stuck

    def status(self) -> dict[str, Any]:
        return {
            "consuming": self.consuming,
            "running_job": self.busy,
            "redis_up": self.redis.up,
            "last_received_at": self.last_received,
            "messages_waiting_since": self.waiting_since,
        }

    # -- the watchdog
    def observe(self, depth: int | None, now: float, *, busy: bool) -> bool:
        """One observation: `depth` messages waiting in the queue (None: Redis did not answer) while
        this worker holds a message or not (`busy`). Returns True when the consumer is judged stuck."""
        self.busy = busy
        if depth is None or busy or depth == 0:
            self.waiting_since = None  # an outage, a job or an empty queue: nothing to judge
        elif self.waiting_since is None or (self.last_received or 0.0) >= self.waiting_since:
            self.waiting_since = now  # first seen waiting, or the consumer took one since
        elif now - self.waiting_since >= self.settings.worker_stuck_seconds:
            self.stuck = True
        return self.stuck

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="loraq-consumer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        queue = self.settings.worker_queue
        client = redis_client(self.settings)
        while not self._stop.wait(CHECK_SECONDS):
            try:
                depth: int | None = kombu_queue_depth(client, queue)
                self.redis.ok()
            except REDIS_OUTAGE as exc:
                depth = None
                self.redis.failed(exc)
            if self.observe(depth, time.time(), busy=holds_requests()):
                waited = time.time() - (self.waiting_since or time.time())
                log.error(
                    "the consumer took no message for %.0fs while %d waited in queue %s and no job ran: "
                    "restarting this worker (exit code %d)",
                    waited, depth, queue, EXIT_DEPENDENCY_DOWN,
                )  # fmt: skip
                request_restart()
                return


def holds_requests() -> bool:
    """Celery's own count: requests this worker received and has not finished (reserved, running,
    or waiting for their ETA), kept in the consumer's process for the solo and the prefork pool."""
    from celery.worker import state

    return bool(state.requests)


_watch: ConsumerWatch | None = None
_exit_code = 0


def current() -> ConsumerWatch | None:
    """This process's watch, once the worker is ready (None before, and outside a worker)."""
    return _watch


def start(settings: Settings | None = None) -> ConsumerWatch:
    """Start watching (Celery's `worker_ready`: the consumer is up)."""
    global _watch
    if _watch is None:
        _watch = ConsumerWatch(settings or get_settings())
        _watch.start()
    return _watch


def stop() -> None:
    if _watch is not None:
        _watch.stop()


def exit_code() -> int:
    """The code `loraq worker` leaves with once Celery returns: `EXIT_DEPENDENCY_DOWN` after the
    watch stopped the worker, else 0."""
    return _exit_code


def request_restart() -> None:
    """Warm shutdown through Celery's own flag (the consumer loop checks it on every turn), then a
    hard exit if the process is still here `FORCE_EXIT_AFTER_S` later."""
    global _exit_code
    from celery.worker import state

    _exit_code = EXIT_DEPENDENCY_DOWN
    state.should_stop = EXIT_DEPENDENCY_DOWN

    def force() -> None:
        time.sleep(FORCE_EXIT_AFTER_S)
        log.error("the worker did not stop within %gs; exiting now", FORCE_EXIT_AFTER_S)
        os._exit(EXIT_DEPENDENCY_DOWN)

    threading.Thread(target=force, name="loraq-force-exit", daemon=True).start()


class ConsumerCollector(Collector):
    """`loraq_redis_up` and `loraq_worker_consuming` of this worker, for its `/metrics`."""

    def collect(self) -> Any:
        watch = current()
        if watch is None:  # not ready yet: nothing known
            return
        yield GaugeMetricFamily(
            "loraq_redis_up", "1 while this process's last Redis call succeeded", value=float(watch.redis.up)
        )
        yield GaugeMetricFamily(
            "loraq_worker_consuming",
            "0 once messages waited untaken in this worker's queue for worker_stuck_seconds",
            value=float(watch.consuming),
        )
