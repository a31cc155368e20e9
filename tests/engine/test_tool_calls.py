"""Tool calls end to end in the engine: a tiny Qwen 3 (its own chat template and tool-call format)
fine-tuned with the job's recipe on a few function-calling lines calls the tool, with the
argument the question asks for, and the serving engine returns it as OpenAI's tool_calls; and the
parser reads each family's format (tests/engine/chat_templates.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.engine.chat_templates import CHATS, family_tokenizer
from tests.engine.test_chat_templates import WEATHER
from tests.engine.tool_call_model import one_torch_thread, question, train_tool_caller
from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from worker.engine.serving import Adapter, GenRequest, load_serving_model
from worker.engine.tool_calls import parse_tool_calls, tool_call_format
from worker.engine.types import RequestError

CITIES = ["Paris", "Oslo"]


@pytest.mark.slow
def test_a_tiny_model_trained_on_tool_calls_calls_the_tool(tmp_path: Path) -> None:
    """Two questions, each answered by a call with its city (tests/engine/tool_call_model.py):
    about 20 s at a load of 8."""
    trained = train_tool_caller(tmp_path, "tiny-qwen3-tools", CITIES)

    serving = load_serving_model("tiny-qwen3-tools", store=trained.store, max_adapters=1, device="cpu")
    assert serving.tool_format == "hermes"
    adapter_config = json.loads((trained.adapter / ADAPTER_CONFIG).read_text())
    adapter = Adapter(config=adapter_config, tensors=load_file(str(trained.adapter / ADAPTER_WEIGHTS)))
    slot = serving.adapter_slot("tools", lambda: adapter)
    tools = [WEATHER]
    requests = [
        GenRequest(serving.prompt_ids(question(c), tools), max_tokens=64, slot=slot, temperature=0.0)
        for c in CITIES
    ]
    with one_torch_thread():
        results = serving.generate(requests)
    for city, result in zip(CITIES, results, strict=True):
        content, calls = parse_tool_calls(result.text, "hermes", tools)
        assert content is None, result.text
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": city})
        ], result.text
        assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    with pytest.raises(RequestError, match="answers no earlier tool call"):
        serving.prompt_ids([*question("Rome"), {"role": "tool", "tool_call_id": "x", "content": "1"}], tools)


@pytest.mark.parametrize("architecture", list(CHATS))
def test_each_familys_call_format_is_read_back(architecture: str) -> None:
    """The call a family's template writes for an assistant turn, parsed back to the call."""
    tok = family_tokenizer(architecture)
    fmt = tool_call_format(tok.chat_template)
    if not CHATS[architecture].tools:
        assert fmt is None
        return
    assert fmt is not None
    arguments = {"city": "Paris", "days": [1, 2]}
    call = {
        "id": "call00001",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    messages: list[Any] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    before = tok.apply_chat_template(
        messages[:1], tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    full = tok.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert isinstance(before, str) and isinstance(full, str) and full.startswith(before)
    turn = full[len(before) :]
    # as the serving engine sees it: decoded without control tokens, up to the end of the turn
    generated = str(tok.decode(tok(turn, add_special_tokens=False)["input_ids"], skip_special_tokens=True))
    content, calls = parse_tool_calls(generated, fmt, [WEATHER])
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", arguments)
    ]


def test_text_that_is_no_call_to_an_offered_tool_stays_content() -> None:
    text = 'Sure. <tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(text, "hermes", [WEATHER]) == (text, [])
    assert (
        parse_tool_calls('{"name": "get_weather", "parameters": "Paris"}', "llama3_json", [WEATHER])[1] == []
    )
    content, calls = parse_tool_calls(
        'It is cold.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "hermes",
        [WEATHER],
    )
    assert content == "It is cold." and len(calls) == 1
