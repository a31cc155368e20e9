"""The dataset rules: which JSONL lines are training examples, and in which format.

Pure Python (json and re, no torch): the API's upload check (`service/api/dataset_summary.py`) and
the engine's loader (`worker/engine/data.py`) both parse every line with `parse_line`, so a file the
API accepts is one the engine can load, and both name a bad line's problem in the same words.

Each non-blank line is a JSON object in one of three formats -- chat (`messages`), `prompt` +
`completion`, or `text` -- and every line of a file uses the format of its first good line
(`FileFormat`). A line's nesting depth and integer sizes are checked before `json.loads` builds
anything, so no line costs a RecursionError or a huge int deep in the parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

DatasetFormat = Literal["chat", "prompt_completion", "text"]

ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = {"role", "content", "weight", "name"}
MAX_JSON_DEPTH = 32  # a chat line nests 3 deep; thousands of levels only hurt the parser
MAX_INT_DIGITS = 32  # no field of a dataset line holds a number anywhere near this long
NO_EXAMPLES = "the file holds no examples"
NO_TRAINABLE_TOKENS = "no trainable tokens (every assistant turn has weight 0?)"
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(rb"[\[\]{}]")


class LineProblem(Exception):
    """Why one line is not an example; the message names the field at fault."""


@dataclass(frozen=True)
class ParsedLine:
    format: DatasetFormat
    record: dict[str, Any]
    messages: int  # chat lines only, else 0
    assistant_messages: int  # chat lines only, else 0
    text_bytes: int  # UTF-8 bytes of the text the example trains on or is prompted with


class FileFormat:
    """Every line of a file uses the format of its first good line."""

    def __init__(self) -> None:
        self.format: DatasetFormat | None = None
        self.first_line = 0

    def check(self, fmt: DatasetFormat, line: int) -> None:
        """Record the first good line's format; raise `LineProblem` for a later line that differs."""
        if self.format is None:
            self.format, self.first_line = fmt, line
        elif fmt != self.format:
            raise LineProblem(
                f"format '{fmt}' differs from the file's format '{self.format}' (line {self.first_line})"
            )


def parse_line(raw: bytes) -> ParsedLine:
    """One JSONL line (bytes, newline included or not) -> its format and record; raises `LineProblem`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineProblem(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    _check_depth(raw)
    try:
        record = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise LineProblem(json_error(exc, text)) from exc
    except RecursionError as exc:  # _check_depth bounds nesting; this is the parser's own guard
        raise LineProblem("JSON nested too deeply") from exc
    if not isinstance(record, dict):
        raise LineProblem(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        n, assistants = _check_messages(record["messages"])
        size = sum(len(m["content"].encode()) for m in record["messages"])
        return ParsedLine("chat", record, n, assistants, size)
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if key not in record:
                raise LineProblem(f"missing field '{key}' (a prompt/completion line needs both)")
            if not isinstance(record[key], str):
                raise LineProblem(f"field '{key}' must be a string, got {type(record[key]).__name__}")
            _check_text(record[key], f"field '{key}'")
        if not record["completion"]:
            raise LineProblem("field 'completion' is empty")
        size = len((record["prompt"] + record["completion"]).encode())
        return ParsedLine("prompt_completion", record, 0, 0, size)
    if "text" in record:
        if not isinstance(record["text"], str):
            raise LineProblem(f"field 'text' must be a string, got {type(record['text']).__name__}")
        if not record["text"].strip():
            raise LineProblem("field 'text' is empty")
        _check_text(record["text"], "field 'text'")
        return ParsedLine("text", record, 0, 0, len(record["text"].encode()))
    keys = ", ".join(sorted(record)) or "none"
    raise LineProblem(
        f"missing field: expected 'messages', 'prompt'+'completion' or 'text' (got keys: {keys})"
    )


def json_error(exc: json.JSONDecodeError, line: str) -> str:
    """A JSON error of one line, at its column counted from the line's first character. The line
    keeps its newline, so `exc.colno` of an error at the end (a missing closing brace) counts on
    the line after it ("line 2 column 1"): the character offset `exc.pos` is the column (one past
    the last character when the line ends too early)."""
    end = len(line.rstrip("\r\n"))
    where = f"column {min(exc.pos, end) + 1}" + (" (the end of the line)" if exc.pos >= end else "")
    return f"not valid JSON: {exc.msg} at {where}"


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise LineProblem(f"a number with {len(digits.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
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
            raise LineProblem(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")


def _check_text(value: str, where: str) -> None:
    # JSON may carry lone UTF-16 surrogates ("\\ud800"): no tokenizer or UTF-8 file can hold them.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise LineProblem(f"{where} holds a lone UTF-16 surrogate at character {exc.start}") from exc


def _check_messages(messages: Any) -> tuple[int, int]:
    """(messages, assistant messages) of a valid chat line; raises `LineProblem` naming the field."""
    if not isinstance(messages, list) or not messages:
        raise LineProblem("field 'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise LineProblem(f"{where} must be an object")
        if "role" not in msg:
            raise LineProblem(f"{where} is missing field 'role'")
        if msg["role"] not in ROLES:
            raise LineProblem(f"{where} has unknown role {msg['role']!r} (allowed: {', '.join(ROLES)})")
        if "content" not in msg:
            raise LineProblem(f"{where} is missing field 'content'")
        if not isinstance(msg["content"], str):
            raise LineProblem(f"{where}.content must be a string, got {type(msg['content']).__name__}")
        if not msg["content"].strip():
            raise LineProblem(f"{where}.content is empty")
        _check_text(msg["content"], f"{where}.content")
        unknown = set(msg) - MESSAGE_KEYS
        if unknown:
            raise LineProblem(f"{where} has unknown field(s): {', '.join(sorted(unknown))}")
        if "weight" in msg:
            if msg["role"] != "assistant":
                raise LineProblem(f"{where}: 'weight' is only allowed on assistant messages")
            if msg["weight"] not in (0, 1) or isinstance(msg["weight"], bool):
                raise LineProblem(f"{where}.weight must be 0 or 1, got {msg['weight']!r}")
    assistants = sum(1 for m in messages if m["role"] == "assistant")
    if assistants == 0:
        raise LineProblem("no assistant message (nothing to train on)")
    if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
        raise LineProblem(NO_TRAINABLE_TOKENS)
    return len(messages), assistants
