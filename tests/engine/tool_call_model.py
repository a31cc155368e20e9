"""A tiny Qwen 3 taught to answer "What is the weather in <city>?" with get_weather(city=<city>):
the function-calling lines, the model and the run that both the engine's test
(tests/engine/test_tool_calls.py) and the API's (tests/service/test_chat_tools.py) train."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tests.engine.chat_templates import family_tokenizer
from tests.engine.test_chat_templates import WEATHER
from tests.engine.tiny_families import tiny_config
from worker.engine.catalog import register_local_model
from worker.engine.recipe import train
from worker.engine.types import LoraConfig, NullCallbacks, TrainConfig


def question(city: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"What is the weather in {city}?"}]


def tool_line(i: int, city: str) -> dict[str, Any]:
    call = {
        "id": f"call{i}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return {
        "messages": [*question(city), {"role": "assistant", "tool_calls": [call]}],
        "tools": [WEATHER],
    }


def tiny_qwen3(directory: Path) -> Path:
    """A random tiny Qwen 3 whose vocabulary holds the family tokenizer's added tokens and whose
    positions reach past the tools' system prompt."""
    tok = family_tokenizer("Qwen3ForCausalLM")
    config = tiny_config("Qwen3ForCausalLM")
    config.vocab_size = 576
    config.max_position_embeddings = 1024
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread: the tiny model's ops are too small to share, and on a busy machine two
    threads wait on each other (0.4 s a step instead of 4 s at a load of 12 on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass(frozen=True)
class ToolCaller:
    store: Path  # the model store `model` is registered in
    base: Path  # the tiny Qwen 3's directory
    adapter: Path  # the trained PEFT adapter


def train_tool_caller(directory: Path, model: str, cities: list[str]) -> ToolCaller:
    """A tiny Qwen 3 registered as `model` in `directory`/models, and its LoRA trained by the
    job's recipe for 100 steps on one line a city (a batch of all of them): enough for 2 cities
    (3 took 120 steps; 90 did not tell Paris from Lima), 5 s on the idle 2-core machine."""
    store = directory / "models"
    base = tiny_qwen3(directory / "base")
    register_local_model(model, base, store)
    lines = directory / "tools.jsonl"
    lines.write_text("".join(json.dumps(tool_line(i, c)) + "\n" for i, c in enumerate(cities)))
    config = TrainConfig(
        model=model,
        train_file=lines,
        output_dir=directory / "out",
        model_store=store,
        lora=LoraConfig(r=16, alpha=32.0),
        max_seq_len=1024,
        batch_size=len(cities),
        max_steps=100,
        learning_rate=1e-2,
        seed=0,
        device="cpu",
    )
    with one_torch_thread():
        adapter = train(config, NullCallbacks()).adapter_dir
    return ToolCaller(store, base, adapter)
