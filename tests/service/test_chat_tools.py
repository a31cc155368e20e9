"""`/v1/chat/completions` with `tools`, through the API and a real `InferenceWorker` on the local
Redis: a tiny Qwen 3 fine-tuned (the engine's recipe, its published chat template) to answer a
weather question with a call is registered as a base model (its LoRA merged into the weights by
PEFT), and the API returns the call as OpenAI's `tool_calls` with finish_reason "tool_calls",
whole and streamed; a conversation whose tool result answers no call, and tools for a model whose
template writes no calls, are 400s naming the field."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import ApiClient
from tests.engine.chat_templates import family_tokenizer
from tests.engine.test_chat_templates import WEATHER
from tests.engine.tool_call_model import question, train_tool_caller
from tests.service.test_chat_api import chat_queue, started_worker
from worker.engine.catalog import register_local_model

pytestmark = pytest.mark.slow
__all__ = ["chat_queue"]  # the fixture, used by name below
MODEL = "tiny-qwen3-weather"


@pytest.fixture(scope="module")
def weather_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny Qwen 3 that answers "What is the weather in Paris?" with get_weather(city=Paris):
    100 steps on that one line (about 8 s on one thread), the adapter merged into the weights."""
    import peft

    tmp = tmp_path_factory.mktemp("weather")
    trained = train_tool_caller(tmp, "tiny-qwen3", ["Paris"])
    base = AutoModelForCausalLM.from_pretrained(trained.base)
    merged = peft.PeftModel.from_pretrained(base, trained.adapter).merge_and_unload()
    merged.save_pretrained(tmp / "merged")
    family_tokenizer("Qwen3ForCausalLM").save_pretrained(tmp / "merged")
    yield tmp / "merged"


def answer(api: ApiClient, body: dict[str, Any]) -> Any:
    """The API's response to `body`, served by an inference worker in a thread."""
    from service.settings import get_settings

    worker: Any = started_worker()
    serving = threading.Thread(target=worker.serve_once, args=(20.0,))
    serving.start()
    try:
        return api.post("/v1/chat/completions", json={**body, "temperature": 0, "max_tokens": 64})
    finally:
        serving.join()
        worker.stop()
        get_settings.cache_clear()


@pytest.mark.usefixtures("chat_queue")
def test_a_model_trained_to_call_the_tool_answers_with_tool_calls(
    api: ApiClient, weather_model: Path
) -> None:
    from service.settings import get_settings

    register_local_model(MODEL, weather_model, get_settings().model_store)
    body = {"model": MODEL, "messages": question("Paris"), "tools": [WEATHER]}

    r = answer(api, body)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    r = answer(api, {**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
    calls = [c for chunk in chunks for ch in chunk["choices"] for c in ch["delta"].get("tool_calls") or []]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"})
    ]
    assert [ch["finish_reason"] for chunk in chunks for ch in chunk["choices"] if ch["finish_reason"]] == [
        "tool_calls"
    ]
    assert not any(ch["delta"].get("content") for chunk in chunks for ch in chunk["choices"])

    # the call answered: the conversation goes on with the result as context
    history = [
        *question("Paris"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "22 C, sunny"},
    ]
    r = answer(api, {**body, "messages": history})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 0

    stray = [*question("Paris"), {"role": "tool", "tool_call_id": "call_x", "content": "22 C"}]
    r = answer(api, {**body, "messages": stray})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
    assert "answers no earlier tool call" in r.json()["error"]["message"]


@pytest.mark.usefixtures("chat_queue")
def test_tools_for_a_template_without_tool_calls_are_refused(api: ApiClient) -> None:
    r = answer(api, {"model": "tiny-llama", "messages": question("Paris"), "tools": [WEATHER]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"
