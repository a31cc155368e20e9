"""Kombu's Redis transport with acknowledgements that outlast a Redis outage
(`broker_transport` in service/broker.py names `Transport`; the URL stays `redis://`).

Why: Kombu's Redis QoS acknowledges a message by removing it from its `unacked` index in Redis and
only then frees the consumer's prefetch slot. When Redis stalls at that moment the removal raises
(`TimeoutError`), Celery logs `CRITICAL Couldn't ack …` and carries on, and the slot is never
freed: with one job per worker (`worker_prefetch_multiplier=1`) the consumer never polls Redis
again, silently, while the worker's heartbeat stays fresh (issue 30). Here an acknowledgement (or a
rejection) is retried with backoff until Redis answers, so the consumer resumes on its own once it
does; a warm or cold shutdown requested meanwhile stops the retrying (the message then stays
`unacked` in Redis, which Kombu restores to its queue after the visibility timeout, and whose
redelivery the job's fenced claim skips).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kombu.transport import redis as kombu_redis

from service.dependency import DependencyHealth
from service.redis_client import REDIS_OUTAGE

log = logging.getLogger("loraq.broker")

ACK_BACKOFF_MAX_S = 2.0


def _shutting_down() -> bool:
    """A warm or cold shutdown of this Celery worker was requested (its signal handlers set these)."""
    from celery.worker import state

    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


class QoS(kombu_redis.QoS):
    def _until_done(self, what: str, call: Any, delivery_tag: str) -> None:
        # short waits: the consumer does nothing else meanwhile, and each try costs one socket timeout
        health = DependencyHealth(f"Redis ({what} of message {delivery_tag})", log, most=ACK_BACKOFF_MAX_S)
        while True:
            try:
                call(delivery_tag)
            except REDIS_OUTAGE as exc:
                if _shutting_down():
                    raise
                time.sleep(health.failed(exc))
                continue
            health.ok()
            return

    def ack(self, delivery_tag: str) -> None:
        self._until_done("acknowledgement", super().ack, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        self._until_done("rejection", lambda tag: super(QoS, self).reject(tag, requeue=requeue), delivery_tag)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel
