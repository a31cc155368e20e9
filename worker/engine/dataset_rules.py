"""The dataset rules: which JSONL lines are training examples, and in which format.

Pure Python (json and re, no torch): the API's upload check (`service/api/dataset_summary.py`) and
the engine's loader (`worker/engine/data.py`) both parse every line with `parse_line`, so a file the
API accepts is one the engine can load, and both name a bad line's problem in the same words.

Each non-blank line is a JSON object in one of four formats -- chat (`messages`), `prompt` +
`completion`, `text`, or a DPO preference pair (OpenAI's: `input` {`messages`, `tools`,
`parallel_tool_calls`}, `preferred_output` and `non_preferred_output`, each one assistant message)
-- and every line of a file uses the format of its first good line (`FileFormat`). A line's
nesting depth and integer sizes are checked before `json.loads` builds
anything, so no line costs a RecursionError or a huge int deep in the parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

DatasetFormat = Literal["chat", "prompt_completion", "text", "preference"]
PREFERENCE_FORMAT: DatasetFormat = "preference"  # what a DPO job trains on; the others are supervised
PREFERENCE_OUTPUTS = ("preferred_output", "non_preferred_output")
PREFERENCE_INPUT_KEYS = {"messages", "tools", "parallel_tool_calls"}

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "weight", "name", "tool_calls", "tool_call_id"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
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
    if "input" in record or any(key in record for key in PREFERENCE_OUTPUTS):
        return _preference_line(record)
    if "messages" in record:
        tools = record.get("tools")
        n, assistants = check_conversation(record["messages"], tools, record.get("parallel_tool_calls", True))
        return ParsedLine("chat", record, n, assistants, conversation_bytes(record["messages"], tools))
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
        "missing field: expected 'messages', 'prompt'+'completion', 'text' or a preference pair "
        f"('input', 'preferred_output', 'non_preferred_output') (got keys: {keys})"
    )


def _preference_line(record: dict[str, Any]) -> ParsedLine:
    """A DPO pair: the prompt conversation `input.messages` (with the `tools` it may call and
    `parallel_tool_calls`), and one assistant answer in each of `preferred_output` and
    `non_preferred_output`, all by the chat rules (`check_conversation`). The pair's text is the
    prompt twice and both answers: what a training row holds of it."""
    for key in ("input", *PREFERENCE_OUTPUTS):
        if key not in record:
            raise LineProblem(
                f"missing field '{key}' (a preference line needs input, {' and '.join(PREFERENCE_OUTPUTS)})"
            )
    source = record["input"]
    if not isinstance(source, dict):
        raise LineProblem(f"field 'input' must be an object, got {type(source).__name__}")
    unknown = set(source) - PREFERENCE_INPUT_KEYS
    if unknown:
        raise LineProblem(f"input has unknown field(s): {', '.join(sorted(unknown))}")
    if "messages" not in source:
        raise LineProblem("input is missing field 'messages'")
    prompt, tools = source["messages"], source.get("tools")
    parallel = source.get("parallel_tool_calls", True)
    # the prompt trains no turn of its own
    check_conversation(prompt, tools, parallel, where="input.messages", needs_assistant=False)
    for i, msg in enumerate(prompt):
        if "weight" in msg:
            raise LineProblem(f"input.messages[{i}]: 'weight' has no meaning in a preference pair's input")
    size = 2 * conversation_bytes(prompt, tools)
    for key in PREFERENCE_OUTPUTS:
        answer = record[key]
        if not isinstance(answer, list) or len(answer) != 1:
            got = f"{len(answer)} messages" if isinstance(answer, list) else type(answer).__name__
            raise LineProblem(f"field '{key}' must be a list of exactly one assistant message, got {got}")
        if isinstance(answer[0], dict) and answer[0].get("role", "assistant") != "assistant":
            raise LineProblem(f"{key}[0] must have role 'assistant', got {answer[0]['role']!r}")
        if isinstance(answer[0], dict) and "weight" in answer[0]:
            raise LineProblem(f"{key}[0]: 'weight' has no meaning in a preference pair")
        check_conversation(answer, tools, parallel, where=key)
        size += conversation_bytes(answer, None)
    return ParsedLine(PREFERENCE_FORMAT, record, len(prompt) + 2, 2, size)


def preference_pair(record: dict[str, Any]) -> list[tuple[list[dict[str, Any]], list[Any]]]:
    """A valid preference line's two conversations (the prompt and the preferred answer, then
    the prompt and the other one), each with the tools the prompt offers (empty: none)."""
    source = record["input"]
    tools = list(source.get("tools") or [])
    return [(list(source["messages"]) + list(record[key]), tools) for key in PREFERENCE_OUTPUTS]


def check_conversation(
    messages: Any,
    tools: Any = None,
    parallel_tool_calls: Any = True,
    *,
    where: str = "messages",
    needs_assistant: bool = True,
) -> tuple[int, int]:
    """(messages, assistant messages) of a valid conversation; raises `LineProblem` naming the field.

    OpenAI's chat format with function calling: `tools` is a list of functions (`check_tools`); an
    assistant message may hold `tool_calls` (each {"id", "type": "function", "function": {"name",
    "arguments"}}: `name` one of `tools`, `arguments` a JSON object written as a string) beside or
    instead of its content; a `tool` message answers an earlier call by its `tool_call_id`; with
    `parallel_tool_calls` false a message makes at most one call. `where` names the list in
    messages ("input.messages" for a preference pair's prompt); `needs_assistant=False` checks a
    conversation that trains no turn of its own (a prompt)."""
    names = check_tools(tools) if tools is not None else set()
    if not isinstance(parallel_tool_calls, bool):
        raise LineProblem(f"field 'parallel_tool_calls' must be true or false, got {parallel_tool_calls!r}")
    if not isinstance(messages, list) or not messages:
        raise LineProblem(f"field '{where}' must be a non-empty list")
    answered: dict[str, bool] = {}  # tool call id -> whether a tool message answered it
    for i, msg in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(msg, dict):
            raise LineProblem(f"{at} must be an object")
        if "role" not in msg:
            raise LineProblem(f"{at} is missing field 'role'")
        role = msg["role"]
        if role not in ROLES:
            raise LineProblem(f"{at} has unknown role {role!r} (allowed: {', '.join(ROLES)})")
        unknown = set(msg) - MESSAGE_KEYS
        if unknown:
            raise LineProblem(f"{at} has unknown field(s): {', '.join(sorted(unknown))}")
        if "tool_calls" in msg and role != "assistant":
            raise LineProblem(f"{at}: 'tool_calls' is only allowed on assistant messages")
        if "tool_call_id" in msg and role != "tool":
            raise LineProblem(f"{at}: 'tool_call_id' is only allowed on tool messages")
        calls = msg.get("tool_calls")
        if calls is not None:
            _check_tool_calls(calls, f"{at}.tool_calls", names, answered, parallel_tool_calls)
        _check_content(msg, at, optional=bool(calls))
        if role == "tool":
            _check_answer(msg.get("tool_call_id"), at, answered)
        if "weight" in msg:
            if role != "assistant":
                raise LineProblem(f"{at}: 'weight' is only allowed on assistant messages")
            if msg["weight"] not in (0, 1) or isinstance(msg["weight"], bool):
                raise LineProblem(f"{at}.weight must be 0 or 1, got {msg['weight']!r}")
    assistants = sum(1 for m in messages if m["role"] == "assistant")
    if needs_assistant and assistants == 0:
        raise LineProblem("no assistant message (nothing to train on)")
    if needs_assistant and not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
        raise LineProblem(NO_TRAINABLE_TOKENS)
    return len(messages), assistants


def check_tools(tools: Any, where: str = "tools") -> set[str]:
    """The function names of a valid `tools` list, OpenAI's [{"type": "function", "function":
    {"name", "description", "parameters"}}]; raises `LineProblem` naming the field."""
    if not isinstance(tools, list):
        raise LineProblem(f"field '{where}' must be a list, got {type(tools).__name__}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise LineProblem(f'{at} must be an object {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise LineProblem(f"{at}.function must be an object")
        unknown = set(function) - FUNCTION_KEYS
        if unknown:
            raise LineProblem(f"{at}.function has unknown field(s): {', '.join(sorted(unknown))}")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise LineProblem(f"{at}.function.name must be a non-empty string")
        if name in names:
            raise LineProblem(f"{at}.function.name {name!r} is defined twice")
        if not isinstance(function.get("description", ""), str):
            raise LineProblem(f"{at}.function.description must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise LineProblem(f"{at}.function.parameters must be a JSON Schema object")
        _check_text(json.dumps(function, ensure_ascii=False), f"{at}.function")
        names.add(name)
    return names


def conversation_bytes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """UTF-8 bytes of a valid conversation's text: contents, tool call arguments and the tools."""
    size = sum(len((m.get("content") or "").encode()) for m in messages)
    size += sum(len(c["function"]["arguments"].encode()) for m in messages for c in m.get("tool_calls") or [])
    return size + (len(json.dumps(tools).encode()) if tools else 0)


def _check_content(msg: dict[str, Any], at: str, *, optional: bool) -> None:
    """`content` is a string, non-empty but for a tool result's; an assistant message that makes
    tool calls may leave it out, null or empty (OpenAI's assistant tool-call messages do)."""
    content = msg.get("content")
    if content is None:
        if optional:
            return
        raise LineProblem(f"{at} is missing field 'content'")
    if not isinstance(content, str):
        raise LineProblem(f"{at}.content must be a string, got {type(content).__name__}")
    if not content.strip() and not optional and msg["role"] != "tool":
        raise LineProblem(f"{at}.content is empty")
    _check_text(content, f"{at}.content")


def _check_tool_calls(
    calls: Any, at: str, names: set[str], answered: dict[str, bool], parallel: bool
) -> None:
    if not isinstance(calls, list) or not calls:
        raise LineProblem(f"{at} must be a non-empty list")
    if len(calls) > 1 and not parallel:
        raise LineProblem(f"{at} makes {len(calls)} calls but 'parallel_tool_calls' is false")
    for j, call in enumerate(calls):
        here = f"{at}[{j}]"
        if not isinstance(call, dict) or set(call) - {"id", "type", "function"}:
            raise LineProblem(f"{here} must be an object with 'id', 'type' and 'function'")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id.strip():
            raise LineProblem(f"{here}.id must be a non-empty string")
        if call_id in answered:
            raise LineProblem(f"{here}.id {call_id!r} is the id of an earlier call")
        if call.get("type", "function") != "function":
            raise LineProblem(f"{here}.type must be 'function', got {call.get('type')!r}")
        function = call.get("function")
        if not isinstance(function, dict) or set(function) != {"name", "arguments"}:
            raise LineProblem(f"{here}.function must be an object with 'name' and 'arguments'")
        name = function["name"]
        if name not in names:
            offered = ", ".join(sorted(names)) or "the line has no 'tools'"
            raise LineProblem(f"{here}.function.name {name!r} is not a tool in 'tools' ({offered})")
        arguments = function["arguments"]
        if not isinstance(arguments, str):
            raise LineProblem(
                f"{here}.function.arguments must be a string of JSON, got {type(arguments).__name__}"
            )
        _check_text(arguments, f"{here}.function.arguments")
        try:
            parsed = json.loads(arguments, parse_int=_bounded_int)
        except json.JSONDecodeError as exc:
            raise LineProblem(
                f"{here}.function.arguments is not JSON: {exc.msg} at character {exc.pos + 1}"
            ) from exc
        except RecursionError as exc:
            raise LineProblem(f"{here}.function.arguments is JSON nested too deeply") from exc
        if not isinstance(parsed, dict):
            raise LineProblem(f"{here}.function.arguments must be a JSON object, got {type(parsed).__name__}")
        answered[call_id] = False


def _check_answer(call_id: Any, at: str, answered: dict[str, bool]) -> None:
    """A tool message's `tool_call_id` answers an earlier call, once."""
    if not isinstance(call_id, str):
        raise LineProblem(f"{at} is missing field 'tool_call_id' (the id of the call it answers)")
    if call_id not in answered:
        raise LineProblem(f"{at}.tool_call_id {call_id!r} answers no earlier tool call")
    if answered[call_id]:
        raise LineProblem(f"{at}.tool_call_id {call_id!r} answers a call that was answered before")
    answered[call_id] = True


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
