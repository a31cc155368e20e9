"""`/v1/chat/completions` through the API process and a real `InferenceWorker` on the local Redis,
in this process: replies slower than Redis clients' default read timeout still arrive, a
missing or silent worker is a clear 503 in OpenAI's error body, and a request waits for a worker
that is starting (a real `loraq inference` process)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ApiClient
from tests.e2e.procs import ROOT, stop_process, wait_for

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
    worker.start()  # tiny-llama loaded; nothing served until serve_once
    worker._register()  # in the workers zset, as serve_forever does first (the heartbeat keeps it)
    return worker


@contextlib.contextmanager
def serving(worker: Any, queue: str) -> Iterator[None]:
    """`worker.serve_forever()` on a thread, in `queue`'s workers zset before the block runs;
    stopped and joined after it."""
    import redis

    from service.inference import inference_worker_id, workers_key
    from tests.servers import shared_redis_url

    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    client = redis.Redis.from_url(shared_redis_url())
    try:
        wait_for(lambda: client.zscore(workers_key(queue), inference_worker_id(os.getpid())) is not None,
                 "worker registered", 60)  # fmt: skip
        yield
    finally:
        worker.stop()
        thread.join(30)
        client.close()


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


def test_a_request_waits_for_a_starting_worker_and_the_command_is_named_only_when_none_is(
    api: ApiClient, chat_queue: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`loraq up` answers before its inference worker has imported torch: a request sent then
    waits for that worker, where it used to be told to start another with `loraq inference`."""
    import redis

    from service.inference import mark_starting, starting_key, workers_key
    from service.settings import get_settings
    from tests.servers import shared_redis_url

    def use(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    client = redis.Redis.from_url(shared_redis_url())
    none = api.post("/v1/chat/completions", json=CHAT)
    assert none.status_code == 503 and none.json()["error"]["code"] == "no_inference_worker"
    assert "start one with `loraq inference`" in none.json()["error"]["message"]

    # one that says it is starting but never serves: a bounded wait, then a 503 naming no command
    use(LORAQ_INFERENCE_START_WAIT_SECONDS="0.5")
    mark_starting(client, chat_queue, "elsewhere:1")
    stuck = api.post("/v1/chat/completions", json=CHAT)
    client.delete(starting_key(chat_queue))
    error = stuck.json()["error"]
    assert stuck.status_code == 503 and error["code"] == "inference_worker_starting", error
    assert "still starting" in error["message"] and "loraq inference" not in error["message"]

    # a real `loraq inference`, asked while it imports torch: the request waits and is answered
    use(LORAQ_INFERENCE_START_WAIT_SECONDS="120")
    log = tmp_path / "inference.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "inference"], env=dict(os.environ), cwd=ROOT,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: client.zcard(starting_key(chat_queue)) == 1, "starting mark", 60, proc)
        assert client.zcard(workers_key(chat_queue)) == 0, log.read_text()  # not serving yet
        answered = api.post("/v1/chat/completions", json=CHAT)
        assert answered.status_code == 200, answered.text
        assert client.zcard(workers_key(chat_queue)) == 1
        wait_for(lambda: client.zcard(starting_key(chat_queue)) == 0, "starting mark removed", 10, proc)
    finally:
        stop_process(proc)


def test_the_first_request_on_a_model_says_it_was_loaded_for_it(api: ApiClient, chat_queue: str) -> None:
    """A worker that preloads nothing loads tiny-llama for the first request on it: the answer says
    so (`notice`, with the seconds it took), the next one does not; both carry tiny-llama's
    random-weights warning."""
    from service.settings import get_settings
    from worker.inference import InferenceWorker

    worker = InferenceWorker(get_settings().model_copy(update={"inference_preload": []}))
    with serving(worker, chat_queue):
        first = api.post("/v1/chat/completions", json=CHAT)
        second = api.post("/v1/chat/completions", json=CHAT)
    assert first.status_code == 200 and second.status_code == 200, first.text + second.text
    notice = first.json()["notice"]
    assert notice.startswith("tiny-llama was loaded on the inference worker for this request first (")
    assert notice.endswith(" s); later requests skip that")
    assert second.json()["notice"] is None
    for answer in (first.json(), second.json()):
        assert answer["warning"].startswith("tiny-llama has random weights (for tests only)")


def test_a_load_longer_than_the_timeout_is_kept_alive_by_loading_events(
    api: ApiClient, chat_queue: str
) -> None:
    """The API gives up on a request after `inference_timeout_seconds` without an event, and a
    large base can take longer to load: while it loads, the worker repeats the "loading" event
    every quarter of its timeout. Here the worker's timeout is 20 ms (a "loading" event every 5
    ms), so even tiny-llama's short load sends several: the request's events, read as the API
    reads them, hold more than one "loading" before "start" (one without the repetition), and the
    answer still comes."""
    import asyncio

    from service import inference
    from service.api.chat import worker_request
    from service.schemas import ChatCompletionCreate
    from service.settings import get_settings
    from worker.inference import InferenceWorker

    settings = get_settings()
    worker = InferenceWorker(
        settings.model_copy(update={"inference_preload": [], "inference_timeout_seconds": 0.02})
    )

    async def events() -> list[dict[str, object]]:
        request = worker_request(
            ChatCompletionCreate.model_validate(CHAT),
            inference.Target("tiny-llama"),
            inference.new_request_id(),
        )
        completion = inference.Completion(settings, request)
        await completion.submit()
        try:
            return [event async for event in completion.events()]
        finally:
            await completion.close()

    with serving(worker, chat_queue):
        got = asyncio.run(events())
    kinds = [str(e["type"]) for e in got]
    start = kinds.index("start")
    assert kinds[:start] == ["loading"] * start and start >= 2, kinds
    assert kinds[-1] == "done"


def test_a_tool_message_needs_the_id_of_its_call_and_content(api: ApiClient) -> None:
    """Refused by the request schema (no worker involved), naming the field: a tool result without
    `tool_call_id`, with a blank one, or without `content`. An empty result ("") is a result."""
    from service.schemas import ChatCompletionCreate

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    asked = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for result, param in [
        ({"role": "tool", "content": "22 C"}, "messages[2].tool_call_id"),
        ({"role": "tool", "tool_call_id": " ", "content": "22 C"}, "messages[2].tool_call_id"),
        ({"role": "tool", "tool_call_id": "call_1"}, "messages[2].content"),
        ({"role": "tool", "tool_call_id": "call_1", "content": None}, "messages[2].content"),
    ]:
        r = api.post("/v1/chat/completions", json={**CHAT, "messages": [*asked, result]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_value"), error
        assert "tool message needs" in error["message"]
    body = ChatCompletionCreate.model_validate(
        {**CHAT, "messages": [*asked, {"role": "tool", "tool_call_id": "call_1", "content": ""}]}
    )
    assert body.messages[2].text() == ""


def test_a_dry_run_of_a_large_file_keeps_the_api_waiting_and_chat_decoding(
    api: ApiClient, chat_queue: str
) -> None:
    """Tokenizing a job's files for its dry run takes as long as the file is large, and the API
    gives up after `inference_timeout_seconds` without an event: the worker sends "progress"
    every quarter of its timeout meanwhile. And it tokenizes on a thread of its own, so a chat
    request sent after the dry run is answered before it. Here the API waits 2 s for an event,
    the worker's "progress" comes every 0.1 s (a 20-fold margin for a loaded machine), and the
    dry run (16,000 chat lines) takes about 4 s on a 2-core machine, checked to outlast the API's
    wait: without the events the API would answer 503 inference_timeout, and without the thread
    the chat would wait for the dry run."""
    import asyncio
    import json
    import time

    from service import inference
    from service.api.chat import worker_request
    from service.schemas import ChatCompletionCreate
    from service.settings import get_settings
    from service.storage import default_store
    from worker.engine.training_config import TrainingConfig
    from worker.inference import InferenceWorker

    def conversation(i: int) -> dict[str, object]:
        question = {"role": "user", "content": f"Question {i} " + "why " * 20}
        return {"messages": [question, {"role": "assistant", "content": "arr " * 30 + str(i)}]}

    lines = [conversation(i) for i in range(16_000)]
    key = f"test/dry-run-{secrets.token_hex(4)}.jsonl"
    default_store().put_bytes(key, "".join(json.dumps(line) + "\n" for line in lines).encode())
    settings = get_settings().model_copy(update={"inference_timeout_seconds": 2.0})  # the API's
    worker = InferenceWorker(settings.model_copy(update={"inference_timeout_seconds": 0.4}))
    dry_request = {
        "kind": "dry_run",
        "id": inference.new_request_id(),
        "base": "tiny-llama",
        "training_file": key,
        "validation_file": None,
        "max_seq_len": 512,
        "training": TrainingConfig().model_dump(mode="json"),
        "n_gpus": 1,
        "validation_split": 0.0,
        "seed": 3,
    }
    chat_request = worker_request(
        ChatCompletionCreate.model_validate(CHAT), inference.Target("tiny-llama"), inference.new_request_id()
    )

    async def replies() -> list[list[tuple[dict[str, object], float]]]:
        sent = [inference.Completion(settings, r) for r in (dry_request, chat_request)]

        async def read(completion: inference.Completion) -> list[tuple[dict[str, object], float]]:
            return [(event, time.monotonic()) async for event in completion.events()]

        try:
            for completion in sent:
                await completion.submit()
            return list(await asyncio.gather(*(read(c) for c in sent)))
        finally:
            for completion in sent:
                await completion.close()

    with serving(worker, chat_queue):
        started = time.monotonic()
        dry, chat = asyncio.run(replies())
    kinds = [str(event["type"]) for event, _ in dry]
    assert kinds[-1] == "done" and kinds[:-1] == ["progress"] * (len(kinds) - 1) and len(kinds) >= 3, kinds
    assert dry[-1][1] - started > settings.inference_timeout_seconds  # it outlasted the API's wait
    done = dry[-1][0]
    assert done["training"]["examples"] == 16_000  # type: ignore[index]
    assert chat[-1][0]["type"] == "done"
    assert chat[-1][1] < dry[-1][1]  # the chat was answered while the dry run worked
