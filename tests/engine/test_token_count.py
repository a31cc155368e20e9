"""The API's torch-free token counter agrees with the engine's tokenization, line by line, and
loads neither torch nor transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import loaded_after
from worker.engine.token_count import load_counter

LINES = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "arr matey"}]},
    {
        "messages": [
            {"role": "system", "content": "be a pirate"},
            {"role": "user", "content": "what is the sea? \u202e \U0001f600 a\x00b"},
            {"role": "assistant", "content": "the sea is wet " * 20, "weight": 1},
            {"role": "user", "content": "and?"},
            {"role": "assistant", "content": "<|im_end|> is a token", "weight": 0},
        ]
    },
]
PLAIN = [
    {"prompt": "question: ", "completion": "answer \u00e9\u00e8"},
    {"prompt": "", "completion": "x" * 300},
]
TEXT = [{"text": "plain text with <|endoftext|> inside and emoji \U0001f680"}]
PAIRS = [  # DPO: a pair counts both its conversations (one row holds both)
    {
        "input": {
            "messages": [{"role": "system", "content": "be a pirate"}, {"role": "user", "content": "hi"}]
        },
        "preferred_output": [{"role": "assistant", "content": "arr matey \U0001f600"}],
        "non_preferred_output": [{"role": "assistant", "content": "hello"}],
    }
]
FORMATS: dict[str, Any] = {
    "chat": LINES,
    "prompt_completion": PLAIN,
    "text": TEXT,
    "preference": PAIRS,
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_counts_equal_the_engines_input_ids(tmp_path: Path, fmt: str) -> None:
    from worker.engine.data import read_examples
    from worker.engine.tiny import build_tiny_tokenizer

    records = FORMATS[fmt]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    engine, report = read_examples(path, build_tiny_tokenizer(), max_seq_len=100_000)
    assert not report.errors, report.errors
    counter = load_counter("tiny-llama", tmp_path)
    assert counter is not None
    assert [counter.count(fmt, r) for r in records] == [len(e.input_ids) for e in engine]


def test_counter_imports_no_torch() -> None:
    code = (
        "import pathlib\nfrom worker.engine.token_count import load_counter\n"
        "assert load_counter('tiny-llama', pathlib.Path('.')).count('text', {'text': 'hello'}) > 1"
    )
    assert loaded_after(code, ("torch", "transformers")) == []


def test_a_gguf_model_without_tokenizer_json_has_no_counter(tmp_path: Path) -> None:
    assert load_counter("smollm2-135m-instruct", tmp_path) is None


# ------------------------------------------------------------------------- the real SmolLM2 (slow)

SMOL = "smollm2-135m-instruct"


@pytest.mark.slow
@pytest.mark.parametrize("records", [LINES, PLAIN, TEXT], ids=["chat", "prompt_completion", "text"])
def test_pulled_gguf_counts_equal_the_engines_input_ids(
    pulled_store: Path, tmp_path: Path, records: list[dict[str, object]]
) -> None:
    from worker.engine.data import read_examples
    from worker.engine.models import load_tokenizer

    assert (pulled_store / SMOL / "tokenizer" / "tokenizer.json").is_file()  # written by the pull
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    engine, report = read_examples(path, load_tokenizer(SMOL, store=pulled_store), max_seq_len=100_000)
    assert not report.errors, report.errors
    counter = load_counter(SMOL, pulled_store)
    assert counter is not None
    fmt = "chat" if "messages" in records[0] else "prompt_completion" if "prompt" in records[0] else "text"
    assert [counter.count(fmt, r) for r in records] == [len(e.input_ids) for e in engine]


@pytest.mark.slow
def test_loading_a_gguf_pulled_without_tokenizer_files_writes_them(
    pulled_store: Path, model_store: Path
) -> None:
    from worker.engine.catalog import PRETRAINED
    from worker.engine.models import load_tokenizer

    gguf = PRETRAINED[SMOL].filename
    (model_store / SMOL).mkdir()
    (model_store / SMOL / gguf).symlink_to(pulled_store / SMOL / gguf)  # a store pulled before the fix
    assert load_counter(SMOL, model_store) is None
    load_tokenizer(SMOL, store=model_store)
    counter = load_counter(SMOL, model_store)
    assert counter is not None and counter.chat_template is not None
    assert counter.count("text", {"text": "hello"}) == 2  # "hello" + EOS
