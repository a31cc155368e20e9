"""Tool calls in generated text, read in the format of the model's chat template (pure Python).

A template that renders `tools` also fixes how an assistant turn writes a call, and a model
fine-tuned on it (worker/engine/chat_format.py trains that text) writes calls the same way:

- "hermes" (Qwen 2.5, Qwen 3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block a call, text before them is the message's content (less Qwen 3's empty `<think>` block);
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` (the control token is
  dropped when the text is decoded, so a JSON list of calls is what is read);
- "llama3_json" (Llama 3.1+): the whole turn is `{"name": ..., "parameters": {...}}`.

`parse_tool_calls` returns OpenAI's `tool_calls` ({"id", "type": "function", "function": {"name",
"arguments": JSON string}}) and what is left of the content; text that is not a well-formed call
to one of the request's tools stays content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, Literal

ToolCallFormat = Literal["hermes", "mistral", "llama3_json"]
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_EMPTY_THINK = re.compile(r"^\s*<think>\s*</think>")  # Qwen 3 opens a turn with one when not reasoning
_ID_CHARS = string.ascii_letters + string.digits


def tool_call_format(template: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template writes, None where it renders no tool calls."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if '"parameters": ' in template and "tool_calls" in template:
        return "llama3_json"
    return None


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, tools: list[dict[str, Any]]
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a generated assistant turn; content is None when only calls were
    written. Calls to functions not in `tools`, or whose arguments are not a JSON object, are text."""
    names = {t["function"]["name"] for t in tools}
    calls: list[dict[str, Any]] = []
    content = text
    if fmt == "hermes":
        kept: list[str] = []
        last = 0
        for match in _HERMES.finditer(text):
            call = _call(_json(match.group(1)), "arguments", names, fmt)
            if call is not None:
                kept.append(text[last : match.start()])
                last = match.end()
                calls.append(call)
        content = _EMPTY_THINK.sub("", "".join([*kept, text[last:]]))
    else:
        found = _json(text.strip().removeprefix("[TOOL_CALLS]").removeprefix("<|python_tag|>"))
        items = found if fmt == "mistral" and isinstance(found, list) else [found]
        key = "arguments" if fmt == "mistral" else "parameters"
        parsed = [_call(item, key, names, fmt) for item in items]
        if items and all(p is not None for p in parsed):
            calls = [p for p in parsed if p is not None]
            content = ""
    return (content.strip() or None) if calls else text, calls


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _call(found: Any, key: str, names: set[str], fmt: ToolCallFormat) -> dict[str, Any] | None:
    if not isinstance(found, dict) or found.get("name") not in names:
        return None
    arguments = found.get(key, found.get("arguments"))
    if not isinstance(arguments, dict):
        return None
    return {
        "id": new_call_id(fmt),
        "type": "function",
        "function": {"name": found["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def new_call_id(fmt: ToolCallFormat) -> str:
    """OpenAI's `call_...`; Mistral's template takes back only 9 letters and digits."""
    if fmt == "mistral":
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
    return "call_" + secrets.token_hex(12)
