"""`loraq inference` rides out a stalled Redis (SIGSTOP of a real redis-server): the serving loop
stays up, says `loraq_redis_up 0` meanwhile, and once Redis answers it registers and serves again
(it used to exit on the first socket timeout, and `loraq up` counted each exit as a crash)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from service.inference import requests_key, workers_key
from service.settings import Settings
from tests.e2e.procs import wait_for
from tests.servers import RedisServer, stallable_redis
from worker.inference import InferenceWorker

STALL_S = 5.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with stallable_redis(tmp_path / "redis") as server:
        yield server


def gauge(worker: InferenceWorker, name: str, **labels: str) -> float | None:
    return worker.metrics.registry.get_sample_value(name, labels or None)


def test_the_inference_worker_serves_again_after_a_redis_stall(server: RedisServer, tmp_path: Path) -> None:
    settings = Settings(
        redis_url=server.url,
        data_dir=tmp_path / "var",
        inference_preload=[],  # no model: this test is about the loop, not decoding
        inference_metrics_port=0,
    )
    worker = InferenceWorker(settings, worker_id="outage-test")
    serving = threading.Thread(target=worker.serve_forever, daemon=True)
    serving.start()
    client = redis.Redis.from_url(server.url)
    key = workers_key(settings.inference_queue)
    try:
        wait_for(lambda: client.zscore(key, "outage-test") is not None, "registered", 60)
        wait_for(lambda: gauge(worker, "loraq_redis_up") == 1.0, "redis up", 10)

        server.stall()
        try:
            wait_for(lambda: gauge(worker, "loraq_redis_up") == 0.0, "outage seen", 10)
            time.sleep(STALL_S)
            assert serving.is_alive()
        finally:
            server.unstall()
        resumed = time.time()

        # registered afresh (the API refuses chat requests to workers silent for 15 s) ...
        wait_for(lambda: (client.zscore(key, "outage-test") or 0) >= resumed, "registered again", 30)
        wait_for(lambda: gauge(worker, "loraq_redis_up") == 1.0, "redis up again", 10)
        # ... and popping requests again: one whose caller has given up is counted and dropped
        stale = {"id": "chatcmpl-stale", "sent_at": 0, "deadline": 1, "base": "tiny-llama", "messages": []}
        client.rpush(requests_key(settings.inference_queue), json.dumps(stale))
        wait_for(
            lambda: gauge(worker, "loraq_inference_requests_total", outcome="expired") == 1.0, "served", 10
        )
        assert serving.is_alive()
    finally:
        worker.stop()
        serving.join(timeout=10)
        client.close()
    assert not serving.is_alive()
