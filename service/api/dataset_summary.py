"""A torch-free structural check of a JSONL dataset, for the dashboard's upload summary.

The rules mirror the engine's parser (`worker/engine/data.py`, which the API may not import): each
non-blank line is a JSON object in one of three formats -- chat (`messages`), `prompt` +
`completion`, or `text` -- and every line of a file uses the format of its first good line.
Token counts are an estimate (UTF-8 bytes / 4): the exact count needs the model's tokenizer, which
only the worker loads; the worker re-validates every line, with the tokenizer, when the job runs.

Bounded (issue 17): a line's byte length is checked before it is read whole (`bounded_lines`), and
its nesting depth and integer sizes before `json.loads` builds anything, so no line costs more
than `max_line_bytes` of memory or a RecursionError/ValueError deep in the parser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "weight", "name"}
BYTES_PER_TOKEN_ESTIMATE = 4
MAX_BAD_LINES_SHOWN = 50
MAX_JSON_DEPTH = 32  # a chat line nests 3 deep; thousands of levels only hurt the parser
MAX_INT_DIGITS = 32  # no field of a dataset line holds a number anywhere near this long
READ_CHUNK = 1 << 20  # an oversized line is skipped in pieces of this size
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


def bounded_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[bytes | int]:
    """The lines of a binary file, each read with at most `max_line_bytes + 1` bytes in memory.

    A line over the limit is skipped in `READ_CHUNK` pieces and yielded as its byte length (an
    int) instead of its bytes, so a 100 MiB line costs 1 MiB, not 100 MiB plus its parse.
    """
    readline = stream.readline
    while True:
        raw: bytes = readline(max_line_bytes + 1)
        if not raw:
            return
        if len(raw) <= max_line_bytes or raw.endswith(b"\n"):
            yield raw
            continue
        size = len(raw)
        while not raw.endswith(b"\n"):
            raw = readline(READ_CHUNK)
            if not raw:
                break
            size += len(raw)
        yield size


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


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _Bad(f"a number with {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(digits)


def _check_depth(raw: bytes) -> None:
    """Nesting depth of `[`/`{` outside strings, without parsing (a cheap count first)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_JSON_STRING.sub(b"", raw)):
        depth += 1 if bracket in (b"[", b"{") else -1
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            raise _Bad(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _check_text(value: str, where: str) -> None:
    # JSON may carry lone UTF-16 surrogates ("\\ud800"): no tokenizer or UTF-8 file can hold them.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Bad(f"{where} holds a lone UTF-16 surrogate at character {exc.start}") from exc


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
        _check_text(msg["content"], f"{where}.content")
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
    if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
        raise _Bad("no trainable tokens (every assistant turn has weight 0?)")  # the engine's words
    return len(messages), assistants


def _parse(raw: bytes) -> tuple[str, int, int, int, dict[str, Any]]:
    """(format, messages, assistant messages, text bytes, the record) of one line; raises `_Bad`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Bad(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    _check_depth(raw)
    try:
        record = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise _Bad(f"not valid JSON: {exc.msg} at column {exc.colno}") from exc
    except RecursionError as exc:  # _check_depth bounds nesting; this is the parser's own guard
        raise _Bad("JSON nested too deeply") from exc
    if not isinstance(record, dict):
        raise _Bad(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        n, assistants = _check_messages(record["messages"])
        size = sum(len(m["content"].encode()) for m in record["messages"])
        return "chat", n, assistants, size, record
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if key not in record:
                raise _Bad(f"missing field '{key}' (a prompt/completion line needs both)")
            if not isinstance(record[key], str):
                raise _Bad(f"field '{key}' must be a string, got {type(record[key]).__name__}")
            _check_text(record[key], f"field '{key}'")
        if not record["completion"]:
            raise _Bad("field 'completion' is empty")
        return "prompt_completion", 0, 0, len((record["prompt"] + record["completion"]).encode()), record
    if "text" in record:
        if not isinstance(record["text"], str):
            raise _Bad(f"field 'text' must be a string, got {type(record['text']).__name__}")
        if not record["text"].strip():
            raise _Bad("field 'text' is empty")
        _check_text(record["text"], "field 'text'")
        return "text", 0, 0, len(record["text"].encode()), record
    keys = ", ".join(sorted(record)) or "none"
    raise _Bad(f"missing field: expected 'messages', 'prompt'+'completion' or 'text' (got keys: {keys})")


def summarize(lines: Iterable[bytes | int], max_line_bytes: int | None = None) -> DatasetSummary:
    """Check every line; count examples and estimated tokens; list bad lines with their numbers.

    An int in `lines` is the length of a line `bounded_lines` skipped as longer than `max_line_bytes`.
    """
    summary = DatasetSummary(format=None)
    first_line = 0

    def bad(number: int, reason: str) -> None:
        summary.bad_line_count += 1
        if len(summary.bad_lines) < MAX_BAD_LINES_SHOWN:
            summary.bad_lines.append(BadLine(number, reason))

    for number, raw in enumerate(lines, start=1):
        if isinstance(raw, int):
            bad(number, f"line is {raw} bytes, over the limit of {max_line_bytes} bytes per line")
            continue
        if not raw.strip():
            continue
        try:
            fmt, n_messages, n_assistant, size, _ = _parse(raw)
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


def status_details(summary: DatasetSummary, shown: int = 3) -> str | None:
    """One line for the file object: why it is `error` (its first bad lines), None when valid."""
    if summary.valid:
        return None
    parts = [f"line {b.line}: {b.reason}" if b.line else b.reason for b in summary.bad_lines[:shown]]
    more = summary.bad_line_count - len(parts)
    tail = f"; and {more} more bad line(s)" if more > 0 else ""
    return f"{summary.bad_line_count} bad line(s): " + "; ".join(parts) + tail


def check_file(path: Path, max_line_bytes: int) -> DatasetSummary:
    """Summarize a stored JSONL file, reading it line by line within `max_line_bytes`."""
    with path.open("rb") as fh:
        return summarize(bounded_lines(fh, max_line_bytes), max_line_bytes)


def examples(path: Path, max_line_bytes: int) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(line number, format, record) of each valid line of a file, read as `check_file` reads it."""
    with path.open("rb") as fh:
        for number, raw in enumerate(bounded_lines(fh, max_line_bytes), start=1):
            if isinstance(raw, int) or not raw.strip():
                continue
            try:
                fmt, _, _, _, record = _parse(raw)
            except _Bad:
                continue
            yield number, fmt, record
