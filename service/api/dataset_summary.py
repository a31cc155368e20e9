"""A torch-free structural check of a JSONL dataset, for the dashboard's upload summary.

The rules mirror the engine's parser (`worker/engine/data.py`, which the API may not import): each
non-blank line is a JSON object in one of three formats -- chat (`messages`), `prompt` +
`completion`, or `text` -- and every line of a file uses the format of its first good line.
Token counts are an estimate (UTF-8 bytes / 4): the exact count needs the model's tokenizer, which
only the worker loads; the worker re-validates every line, with the tokenizer, when the job runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "weight", "name"}
BYTES_PER_TOKEN_ESTIMATE = 4
MAX_BAD_LINES_SHOWN = 50


@dataclass
class BadLine:
    line: int  # 1-based
    reason: str


@dataclass
class DatasetSummary:
    format: str | None
    examples: int = 0
    messages: int = 0
    assistant_messages: int = 0
    tokens: int = 0  # estimated, see token_count_method
    max_example_tokens: int = 0
    bad_line_count: int = 0
    bad_lines: list[BadLine] = field(default_factory=list)  # the first MAX_BAD_LINES_SHOWN
    token_count_method: str = f"estimated: UTF-8 bytes / {BYTES_PER_TOKEN_ESTIMATE}"

    @property
    def valid(self) -> bool:
        return self.bad_line_count == 0 and self.examples > 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "valid": self.valid}


class _Bad(Exception):
    pass


def _check_messages(messages: Any) -> tuple[int, int]:
    """(messages, assistant messages) of a valid chat line; raises `_Bad` naming the field."""
    if not isinstance(messages, list) or not messages:
        raise _Bad("field 'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _Bad(f"{where} must be an object")
        if "role" not in msg:
            raise _Bad(f"{where} is missing field 'role'")
        if msg["role"] not in ROLES:
            raise _Bad(f"{where} has unknown role {msg['role']!r} (allowed: {', '.join(ROLES)})")
        if "content" not in msg:
            raise _Bad(f"{where} is missing field 'content'")
        if not isinstance(msg["content"], str):
            raise _Bad(f"{where}.content must be a string, got {type(msg['content']).__name__}")
        if not msg["content"].strip():
            raise _Bad(f"{where}.content is empty")
        unknown = set(msg) - MESSAGE_KEYS
        if unknown:
            raise _Bad(f"{where} has unknown field(s): {', '.join(sorted(unknown))}")
        if "weight" in msg:
            if msg["role"] != "assistant":
                raise _Bad(f"{where}: 'weight' is only allowed on assistant messages")
            if msg["weight"] not in (0, 1) or isinstance(msg["weight"], bool):
                raise _Bad(f"{where}.weight must be 0 or 1, got {msg['weight']!r}")
    assistants = sum(1 for m in messages if m["role"] == "assistant")
    if assistants == 0:
        raise _Bad("no assistant message (nothing to train on)")
    return len(messages), assistants


def _parse(raw: bytes) -> tuple[str, int, int, int]:
    """(format, messages, assistant messages, text bytes) of one line; raises `_Bad`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Bad(f"not valid JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(record, dict):
        raise _Bad(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        n, assistants = _check_messages(record["messages"])
        size = sum(len(m["content"].encode()) for m in record["messages"])
        return "chat", n, assistants, size
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if key not in record:
                raise _Bad(f"missing field '{key}' (a prompt/completion line needs both)")
            if not isinstance(record[key], str):
                raise _Bad(f"field '{key}' must be a string, got {type(record[key]).__name__}")
        if not record["completion"]:
            raise _Bad("field 'completion' is empty")
        return "prompt_completion", 0, 0, len((record["prompt"] + record["completion"]).encode())
    if "text" in record:
        if not isinstance(record["text"], str):
            raise _Bad(f"field 'text' must be a string, got {type(record['text']).__name__}")
        if not record["text"].strip():
            raise _Bad("field 'text' is empty")
        return "text", 0, 0, len(record["text"].encode())
    keys = ", ".join(sorted(record)) or "none"
    raise _Bad(f"missing field: expected 'messages', 'prompt'+'completion' or 'text' (got keys: {keys})")


def summarize(lines: Iterable[bytes]) -> DatasetSummary:
    """Check every line; count examples and estimated tokens; list bad lines with their numbers."""
    summary = DatasetSummary(format=None)
    first_line = 0

    def bad(number: int, reason: str) -> None:
        summary.bad_line_count += 1
        if len(summary.bad_lines) < MAX_BAD_LINES_SHOWN:
            summary.bad_lines.append(BadLine(number, reason))

    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            fmt, n_messages, n_assistant, size = _parse(raw)
        except _Bad as exc:
            bad(number, str(exc))
            continue
        if summary.format is None:
            summary.format, first_line = fmt, number
        elif fmt != summary.format:
            first = f"the file's format '{summary.format}' (line {first_line})"
            bad(number, f"format '{fmt}' differs from {first}")
            continue
        tokens = -(-size // BYTES_PER_TOKEN_ESTIMATE)  # ceil
        summary.examples += 1
        summary.messages += n_messages
        summary.assistant_messages += n_assistant
        summary.tokens += tokens
        summary.max_example_tokens = max(summary.max_example_tokens, tokens)
    if summary.examples == 0 and summary.bad_line_count == 0:
        bad(0, "the file holds no examples")
    return summary
