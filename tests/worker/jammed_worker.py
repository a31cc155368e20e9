"""`loraq worker` (the real command, with its arguments) whose consumer can never take a message:
the state a failed acknowledgement left Kombu's Redis QoS in before service/broker_transport.py,
its one prefetch slot held by a delivery nothing will free. tests/worker/test_consumer_watch.py
runs it as `python -m tests.worker.jammed_worker worker --queue Q` to see the watch catch it."""

from __future__ import annotations

from typing import Any

from celery.signals import worker_ready


@worker_ready.connect
def _jam(sender: Any, **_: object) -> None:
    sender.task_consumer.channel.qos._delivered["jammed"] = None  # sender: the worker's consumer


if __name__ == "__main__":
    from service.cli import app

    app()
