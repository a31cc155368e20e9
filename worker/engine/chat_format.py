"""Conversations rendered by the model's own chat template, and the spans of text a run trains.

Pure Python (json only, no torch or transformers): the engine renders with the tokenizer's
`apply_chat_template`, the API's torch-free token counter with jinja2 as transformers does; both
come here with a `Render` callable, so a line is the same text on both sides.

OpenAI's messages become the template's (`template_messages`): a tool call's `arguments` (a JSON
string in OpenAI's format) becomes the object templates expect (Llama 3.1 and Qwen 2.5 `tojson`
it), a null `content` becomes "", a `tool` result also names the function it answers, and the
`weight` key stays out. `tools` (OpenAI's list of functions) is handed to the template as it is.

The loss of an assistant turn covers what the model is asked to generate for it
(`assistant_spans`): from the end of the generation prompt of the conversation before it (the
template's assistant header: ChatML's '<|im_start|>assistant\\n', Gemma's '<start_of_turn>model\\n',
Llama 3's '<|start_header_id|>assistant<|end_header_id|>\\n\\n') through the template's end-of-turn
text (`end_of_turn`: '<|im_end|>\\n', '<end_of_turn>\\n', '<|eot_id|>', '</s>', '<|end|>\\n'), tool
calls included as the template writes them (Qwen's '<tool_call>...</tool_call>', Llama 3's JSON,
Mistral's '[TOOL_CALLS]'). Whatever the template writes inside the turn is trained as written:
Qwen 3 opens the last turn with a '<think>' block (empty, or the reasoning the content carried)
and strips it from earlier turns, so the last turn trains its thinking tags and the earlier ones
do not. The end is found in the rendering of the whole conversation, so a template that renders
a turn differently once the conversation goes on (Qwen 3's) still gets its spans; what must hold
is that the conversation before each trained turn renders as a prefix of the whole one (else the
prefix of a rendering that ends with that turn, as Mistral's template moves the system message
into the last user turn). A template that leaves out tools, tool calls or tool results is refused,
line by line, instead of training on a conversation without them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from worker.engine.dataset_rules import LineProblem
from worker.engine.types import ModelError

# (template messages, tools or None, add_generation_prompt) -> the rendered text
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool], str]
Span = tuple[int, int]  # [start, end) character offsets in the rendered text
Offsets = Callable[[str], list[Span]]  # a text's tokens, as the character span of each

_MARK = "\x00LORAQ\x00"  # stands for a turn's content: no template trims or rewrites it


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A valid OpenAI conversation (dataset_rules.check_conversation) as chat templates take it."""
    names: dict[str, str] = {}  # tool call id -> its function's name
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                function = call["function"]
                names[call["id"]] = function["name"]
                arguments = json.loads(function["arguments"])
                calls.append(
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": function["name"], "arguments": arguments},
                    }
                )
            msg["tool_calls"] = (
                calls  # only when present: Llama 3.1's template tests `'tool_calls' in message`
            )
        if m["role"] == "tool":
            msg["tool_call_id"] = m["tool_call_id"]
            if m["tool_call_id"] in names:
                msg["name"] = names[m["tool_call_id"]]
        out.append(msg)
    return out


def render_or_refuse(render: Render, messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
    """`render(...)`; a template's own error (raise_exception, a missing key) as a LineProblem."""
    try:
        return render(messages, tools, generation)
    except Exception as exc:  # jinja2 raises anything a template does; each is the line's problem
        raise LineProblem(f"the model's chat template refused the conversation: {exc}") from exc


def end_of_turn(render: Render, offsets: Offsets) -> str:
    """The text a template puts after an assistant turn's content before the next turn (or the
    end): the tokens that follow the content both in a conversation that ends with the turn and in
    one that goes on with a user turn. '<|im_end|>\\n' for ChatML, '</s>' for Mistral, '<|end|>\\n'
    for Phi-3 (whose rendering ends with '<|endoftext|>' after it: compared by tokens, not by
    characters, as '<|endoftext|>' and '<|user|>' share their first two)."""
    user = {"role": "user", "content": "hi"}
    turn = {"role": "assistant", "content": _MARK}
    tails = []
    for conversation in ([user, turn], [user, turn, {"role": "user", "content": "ok"}]):
        try:
            text = render(conversation, None, False)
        except Exception as exc:
            raise ModelError(
                f"the model's chat template cannot render a user/assistant conversation: {exc}"
            ) from exc
        if _MARK not in text:
            raise ModelError("the model's chat template does not render an assistant message's content")
        tails.append(text[text.index(_MARK) + len(_MARK) :])
    final, going_on = ([tail[a:b] for a, b in offsets(tail)] for tail in tails)
    n = 0
    while n < min(len(final), len(going_on)) and final[n] == going_on[n]:
        n += 1
    eot = "".join(final[:n])
    if not eot:
        raise ModelError(
            "the model's chat template writes nothing after an assistant turn, so the model could not "
            "learn where a turn ends"
        )
    return eot


def assistant_spans(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    render: Render,
    eot: str,
    *,
    where: str = "messages",
) -> tuple[str, list[Span]]:
    """The whole conversation rendered, and the spans of its weight-1 assistant turns (see the
    module docstring); `eot` is `end_of_turn(render)`. Raises LineProblem naming the message."""
    conversation = template_messages(messages)
    full = render_or_refuse(render, conversation, tools, False)
    spans: list[Span] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or msg.get("weight", 1) == 0:
            continue
        start = _turn_start(conversation, i, tools, render, full, f"{where}[{i}]")
        end = full.find(eot, start)
        if end < 0:
            raise LineProblem(
                f"{where}[{i}]: the chat template does not end this assistant turn with {eot!r}"
            )
        end += len(eot)
        if spans and start < spans[-1][1]:
            raise LineProblem(
                f"{where}[{i}]: the chat template renders this assistant turn inside the previous one"
            )
        for call in msg.get("tool_calls") or []:
            if call["function"]["name"] not in full[start:end]:
                raise LineProblem(
                    f"{where}[{i}]: the model's chat template does not render tool calls (the call to "
                    f"{call['function']['name']!r} is missing from the assistant turn)"
                )
        spans.append((start, end))
    _check_rendered(messages, full, where)
    _check_tools_rendered(messages, tools, full, where)
    return full, spans


def prompt_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, render: Render) -> str:
    """What the model continues for a chat request: the conversation and the generation prompt."""
    text = render_or_refuse(render, template_messages(messages), tools, True)
    _check_tools_rendered(messages, tools, text, "messages")
    return text


def _turn_start(
    conversation: list[dict[str, Any]], i: int, tools: Any, render: Render, full: str, at: str
) -> int:
    if i:
        before = render_or_refuse(render, conversation[:i], tools, True)
        if full.startswith(before):
            return len(before)
    # The text before this turn's content in a rendering that ends with the turn (a conversation
    # that starts with the assistant; Mistral's template, which renders the system message only
    # into a conversation's last user turn).
    through = render_or_refuse(
        render, [*conversation[:i], {"role": "assistant", "content": _MARK}], tools, False
    )
    k = through.find(_MARK)
    if k >= 0 and full.startswith(through[:k]):
        return k
    raise LineProblem(
        f"{at}: the model's chat template renders the conversation before this assistant turn "
        "differently from the whole conversation, so the turn cannot be located"
    )


def _check_rendered(messages: list[dict[str, Any]], text: str, where: str) -> None:
    """Every system and user message is in the text: Mistral's template renders the system message
    only into a last user turn, so a conversation that ends with an assistant turn trains without it."""
    for i, msg in enumerate(messages):
        if msg["role"] in ("system", "user") and msg["content"].strip() not in text:
            raise LineProblem(
                f"{where}[{i}]: the model's chat template leaves this {msg['role']} message out of a "
                "conversation that ends with an assistant turn, so it would not be trained on"
            )


def _check_tools_rendered(messages: list[dict[str, Any]], tools: Any, text: str, where: str) -> None:
    for tool in tools or []:
        if tool["function"]["name"] not in text:
            raise LineProblem(
                f"the model's chat template does not render 'tools' (tool {tool['function']['name']!r} "
                "is missing from the rendered conversation)"
            )
    for i, msg in enumerate(messages):
        result = (msg.get("content") or "").strip()
        # as written, or as a JSON string (Llama 3.1's template `tojson`s a result)
        if (
            msg["role"] == "tool"
            and result not in text
            and json.dumps(result, ensure_ascii=False)[1:-1] not in text
        ):
            raise LineProblem(f"{where}[{i}]: the model's chat template does not render tool results")
