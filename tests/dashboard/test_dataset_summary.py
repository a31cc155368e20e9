"""The dashboard's torch-free dataset summary agrees with the engine's validator on which lines
are bad (line numbers and reasons), and estimates tokens within a sane factor of the real count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.api.dataset_summary import summarize
from tests.e2e.datasets import broken_lines, chat_lines

ANSWER = {"role": "assistant", "content": "b"}
LINES = [
    json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
    "{not json",
    json.dumps(["a", "list"]),
    "",  # blank lines are skipped, not bad
    json.dumps({"messages": []}),
    json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
    json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}),
    json.dumps({"messages": [{"role": "assistant", "content": 3}]}),
    json.dumps({"prompt": "p", "completion": "c"}),  # a valid line of another format
    json.dumps(
        {"messages": [{"role": "user", "content": "a", "extra": 1}, {"role": "assistant", "content": "b"}]}
    ),
    json.dumps(
        {"messages": [{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a"}]}
    ),
    json.dumps({"nothing": "useful"}),
    json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}]}
    ),
]


def test_bad_lines_named_with_numbers_and_reasons() -> None:
    s = summarize(line.encode() + b"\n" for line in LINES)
    bad = {b.line: b.reason for b in s.bad_lines}
    assert s.format == "chat" and s.examples == 1 and not s.valid
    assert sorted(bad) == [2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert bad[2].startswith("not valid JSON")
    assert bad[3] == "expected a JSON object, got list"
    assert bad[5] == "field 'messages' must be a non-empty list"
    assert bad[6] == "no assistant message (nothing to train on)"
    assert "unknown role 'robot'" in bad[7]
    assert bad[8] == "messages[0].content must be a string, got int"
    assert bad[9] == "format 'prompt_completion' differs from the file's format 'chat' (line 1)"
    assert bad[10] == "messages[0] has unknown field(s): extra"
    assert bad[11] == "messages[0]: 'weight' is only allowed on assistant messages"
    assert "missing field" in bad[12] and "got keys: nothing" in bad[12]
    assert bad[13] == "no trainable tokens (every assistant turn has weight 0?)"


def test_empty_file_is_not_valid() -> None:
    s = summarize([b"\n", b"  \n"])
    assert not s.valid and [(b.line, b.reason) for b in s.bad_lines] == [(0, "the file holds no examples")]


def test_good_file_counts() -> None:
    s = summarize(chat_lines(16).splitlines(keepends=True))
    assert s.valid and s.examples == 16 and s.messages == 48 and s.assistant_messages == 16
    assert s.tokens > 0 and s.to_dict()["valid"] is True


@pytest.mark.parametrize("content", [b"\n".join(line.encode() for line in LINES) + b"\n", broken_lines()])
def test_agrees_with_engine_validator(tmp_path: Path, content: bytes) -> None:
    # The engine (with the real tiny-llama tokenizer) is the reference for which lines are bad.
    from worker.engine.data import validate_dataset
    from worker.engine.tiny import build_tiny_tokenizer

    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    engine = validate_dataset(path, build_tiny_tokenizer(), max_seq_len=4096)
    ours = summarize(content.splitlines(keepends=True))
    assert [(b.line, b.reason) for b in ours.bad_lines] == [(e.line, e.reason) for e in engine.errors]
    assert ours.examples == engine.examples


def test_token_estimate_is_within_a_factor_of_the_real_count(tmp_path: Path) -> None:
    from worker.engine.data import validate_dataset
    from worker.engine.tiny import build_tiny_tokenizer

    content = chat_lines(32)
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    engine = validate_dataset(path, build_tiny_tokenizer(), max_seq_len=4096)
    ours = summarize(content.splitlines(keepends=True))
    # The estimate counts message text only; the real count adds the chat template's tokens.
    assert engine.tokens / 4 <= ours.tokens <= engine.tokens * 4, (ours.tokens, engine.tokens)
