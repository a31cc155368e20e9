"""service/broker_transport.py on a real redis-server that is stopped (SIGSTOP) mid-acknowledgement:
the ack waits for Redis instead of failing, and the consumer's prefetch slot is freed, so the next
message is delivered; a shutdown requested meanwhile ends the waiting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Message, Queue

from service.broker import KOMBU_UNACKED_KEY, make_celery
from service.settings import Settings
from tests.servers import RedisServer, stallable_redis

STALL_S = 3.0
QUEUE = "outage-test"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with stallable_redis(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def connection(server: RedisServer) -> Iterator[Connection]:
    app = make_celery(Settings(redis_url=server.url, worker_queue=QUEUE))
    with app.connection_for_write() as conn:
        assert type(conn.transport).__module__ == "service.broker_transport"
        with conn.Producer() as producer:
            for n in (1, 2):
                producer.publish({"n": n}, routing_key=QUEUE, declare=[Queue(QUEUE)])
        yield conn


def take_one(conn: Connection, consumer: Consumer, got: list[Message]) -> Message:
    before = len(got)
    deadline = time.monotonic() + 10
    while len(got) == before:
        assert time.monotonic() < deadline, "no message delivered"
        try:
            conn.drain_events(timeout=0.5)
        except TimeoutError:
            continue
    return got[-1]


def consume(conn: Connection) -> tuple[Consumer, list[Message]]:
    """A consumer with one message in flight at most, as a worker's (prefetch 1)."""
    got: list[Message] = []
    consumer = Consumer(conn.default_channel, queues=[Queue(QUEUE)], callbacks=[lambda _b, m: got.append(m)])
    consumer.qos(prefetch_count=1)
    consumer.consume()
    return consumer, got


def test_an_ack_during_a_stall_waits_for_redis_and_frees_the_consumer(
    server: RedisServer, connection: Connection
) -> None:
    consumer, got = consume(connection)
    first = take_one(connection, consumer, got)
    assert first.payload == {"n": 1}
    qos: Any = connection.default_channel.qos
    assert not qos.can_consume()  # its one slot is taken until the ack

    server.stall()
    errors: list[BaseException] = []

    def ack() -> None:
        try:
            first.ack()
        except BaseException as e:
            errors.append(e)

    t0 = time.monotonic()
    acking = threading.Thread(target=ack)
    acking.start()
    time.sleep(STALL_S)
    assert acking.is_alive() and not qos.can_consume()  # still waiting for Redis, not given up
    server.unstall()
    acking.join(timeout=30)
    assert not acking.is_alive() and errors == []
    assert time.monotonic() - t0 >= STALL_S

    client = redis.Redis.from_url(server.url)
    assert qos.can_consume() and client.hlen(KOMBU_UNACKED_KEY) == 0  # acked in Redis too
    second = take_one(connection, consumer, got)
    assert second.payload == {"n": 2}
    assert client.hlen(KOMBU_UNACKED_KEY) == 1


def test_a_shutdown_requested_during_the_stall_ends_the_waiting(
    server: RedisServer, connection: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery.worker import state

    consumer, got = consume(connection)
    first = take_one(connection, consumer, got)
    monkeypatch.setattr(state, "should_stop", 0)  # a warm shutdown with exit code 0 (falsy, yet set)
    server.stall()
    t0 = time.monotonic()
    with pytest.raises(redis.exceptions.TimeoutError):
        first.ack()
    assert time.monotonic() - t0 < STALL_S  # one socket timeout, no retries
