"""`/v1/chat/completions` through the API process and a real `InferenceWorker` on the local Redis,
in this process: replies slower than Redis clients' default read timeout still arrive, and a
missing or silent worker is a clear 503 in OpenAI's error body."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator

import pytest

from tests.conftest import ApiClient

CHAT = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "temperature": 0,
}


@pytest.fixture
def chat_queue(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from service.settings import get_settings

    queue = f"chat-{secrets.token_hex(4)}"
    monkeypatch.setenv("LORAQ_INFERENCE_QUEUE", queue)
    monkeypatch.setenv("LORAQ_INFERENCE_METRICS_PORT", "0")
    get_settings.cache_clear()
    yield queue
    get_settings.cache_clear()


def started_worker(**overrides: object) -> object:
    from service.settings import get_settings
    from worker.inference import InferenceWorker

    worker = InferenceWorker(get_settings().model_copy(update=overrides))
    worker.start()  # heartbeat on, tiny-llama loaded; nothing served until serve_once
    return worker


def test_a_first_event_later_than_redis_default_read_timeout_arrives(api: ApiClient, chat_queue: str) -> None:
    worker = started_worker()
    # The worker takes the request only after 6.5 s: longer than redis-py's 5 s socket timeout.
    late = threading.Timer(6.5, worker.serve_once, args=(10.0,))  # type: ignore[attr-defined]
    late.start()
    try:
        r = api.post("/v1/chat/completions", json=CHAT)
    finally:
        late.join()
        worker.stop()  # type: ignore[attr-defined]
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_no_worker_and_a_silent_worker_are_503(
    api: ApiClient, chat_queue: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import get_settings

    r = api.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_inference_worker"
    assert chat_queue in r.json()["error"]["message"]

    worker = started_worker()  # alive (heartbeat) but never serving
    monkeypatch.setenv("LORAQ_INFERENCE_TIMEOUT_SECONDS", "1")
    get_settings.cache_clear()
    try:
        r = api.post("/v1/chat/completions", json=CHAT)
    finally:
        worker.stop()  # type: ignore[attr-defined]
    assert r.status_code == 503 and r.json()["error"]["code"] == "inference_timeout"
