"""Training renders each family's own chat template (tests/engine/chat_templates.py: the published
templates of Qwen 3, Qwen 2.5, Llama 3.1, Mistral Nemo, Gemma 3 and Phi-3.5), and exactly the
assistant turns are trained: their text as the template writes it (tool calls in the family's
format, Qwen 3's thinking tags on the last turn) and their end-of-turn token, never a system, user
or tool message, a header or a weight-0 turn. Bad function-calling lines are named at upload
(dataset_rules.parse_line) and the API's token counter counts what the engine tokenizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.engine.chat_templates import CHATS, family_tokenizer
from worker.engine.data import read_examples
from worker.engine.dataset_rules import LineProblem, parse_line
from worker.engine.token_count import TokenCounter

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_ID = "call00001"  # Mistral's template takes 9-character ids only
CALL: dict[str, Any] = {
    "id": CALL_ID,
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
SYSTEM = {"role": "system", "content": "Be brief."}
GREETING = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
ASK = {"role": "user", "content": "Weather in Paris?"}
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "22 C, sunny"},
]
ANSWER = {"role": "assistant", "content": "It is 22 C and sunny."}


def conversation(architecture: str) -> dict[str, Any]:
    """A system message (not Mistral's: its template drops it, see below), a greeting, a question,
    a tool call and its result where the template renders tools (Mistral's only in a single user
    turn: it puts the tools before the last one), and the answer."""
    if architecture == "MistralForCausalLM":
        return {"messages": [ASK, *TOOL_TURNS, ANSWER], "tools": [WEATHER]}
    if CHATS[architecture].tools:
        return {"messages": [SYSTEM, *GREETING, ASK, *TOOL_TURNS, ANSWER], "tools": [WEATHER]}
    return {"messages": [SYSTEM, *GREETING, ASK, ANSWER]}


# What each family trains, written out by hand from its template: one string a trained turn.
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
TRAINED = {
    "Qwen3ForCausalLM": [
        "Hello!<|im_end|>\n",
        QWEN_CALL,
        # the last turn after the question opens with a thinking block (empty: no reasoning given)
        "<think>\n\n</think>\n\nIt is 22 C and sunny.<|im_end|>\n",
    ],
    "Qwen2ForCausalLM": ["Hello!<|im_end|>\n", QWEN_CALL, "It is 22 C and sunny.<|im_end|>\n"],
    "LlamaForCausalLM": [
        "Hello!<|eot_id|>",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "It is 22 C and sunny.<|eot_id|>",
    ],
    "MistralForCausalLM": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s>',
        "It is 22 C and sunny.</s>",
    ],
    "Gemma3ForCausalLM": ["Hello!<end_of_turn>\n", "It is 22 C and sunny.<end_of_turn>\n"],
    "Phi3ForCausalLM": ["Hello!<|end|>\n", "It is 22 C and sunny.<|end|>\n"],
}


def trained_runs(tmp_path: Path, architecture: str, records: list[dict[str, Any]]) -> list[list[str]]:
    """Each line's trained tokens, decoded run by run (a run: consecutive trained tokens)."""
    tok = family_tokenizer(architecture)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    examples, report = read_examples(path, tok, max_seq_len=4096)
    assert report.ok, report.errors
    out = []
    for e in examples:
        runs: list[list[int]] = []
        for t, (token, label) in enumerate(zip(e.input_ids, e.labels, strict=True)):
            if label == -100:
                continue
            if not runs or e.labels[t - 1] == -100:
                runs.append([])
            runs[-1].append(token)
        out.append([str(tok.decode(run, clean_up_tokenization_spaces=False)) for run in runs])
    return out


@pytest.mark.parametrize("architecture", list(CHATS))
def test_exactly_the_assistant_turns_are_trained(architecture: str, tmp_path: Path) -> None:
    tok = family_tokenizer(architecture)
    record = conversation(architecture)
    [runs] = trained_runs(tmp_path, architecture, [record])
    assert runs == TRAINED[architecture]
    # and each trained turn ends with the template's end-of-turn token, one id
    eot = {
        "LlamaForCausalLM": "<|eot_id|>",
        "MistralForCausalLM": "</s>",
        "Gemma3ForCausalLM": "<end_of_turn>",
    }
    eot_id = tok.convert_tokens_to_ids(
        eot.get(architecture, "<|end|>" if "Phi3" in architecture else "<|im_end|>")
    )
    ids = tok(runs[-1], add_special_tokens=False)["input_ids"]
    assert eot_id in ids


@pytest.mark.parametrize("architecture", list(CHATS))
def test_a_weight_0_turn_is_context(architecture: str, tmp_path: Path) -> None:
    messages: list[dict[str, Any]] = [*GREETING, {"role": "user", "content": "And now?"}]
    messages.append({"role": "assistant", "content": "Now."})
    messages[1] = {**messages[1], "weight": 0}
    [runs] = trained_runs(tmp_path, architecture, [{"messages": messages}])
    assert runs == [TRAINED[architecture][-1].replace("It is 22 C and sunny.", "Now.")]


def test_qwen3_trains_the_last_turns_thinking_and_strips_the_earlier(tmp_path: Path) -> None:
    record = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nHello!"},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4."},
        ]
    }
    [runs] = trained_runs(tmp_path, "Qwen3ForCausalLM", [record])
    assert runs == ["Hello!<|im_end|>\n", "<think>\nTwo and two.\n</think>\n\n4.<|im_end|>\n"]


@pytest.mark.parametrize(
    ("architecture", "record", "problem"),
    [
        # Gemma 3 and Phi-3.5 templates have no tools: refused, not trained without the calls
        (
            "Gemma3ForCausalLM",
            {"messages": [ASK, *TOOL_TURNS, ANSWER], "tools": [WEATHER]},
            "roles must alternate",
        ),
        ("Phi3ForCausalLM", {"messages": [ASK, *TOOL_TURNS, ANSWER], "tools": [WEATHER]}, "does not render"),
        # Mistral's template renders the system message only into a conversation's last user turn
        (
            "MistralForCausalLM",
            {"messages": [SYSTEM, *GREETING]},
            "messages[0]: the model's chat template leaves",
        ),
        # ... and its tools before the last user turn: an earlier turn's context is not a prefix
        (
            "MistralForCausalLM",
            {"messages": [*GREETING, ASK, *TOOL_TURNS, ANSWER], "tools": [WEATHER]},
            "messages[1]",
        ),
        # Llama 3.1's template makes one call a turn
        (
            "LlamaForCausalLM",
            {
                "messages": [ASK, {**TOOL_TURNS[0], "tool_calls": [CALL, {**CALL, "id": "call00002"}]}],
                "tools": [WEATHER],
            },
            "single tool-calls",
        ),
    ],
)
def test_a_conversation_the_template_cannot_render_is_a_line_error(
    architecture: str, record: dict[str, Any], problem: str, tmp_path: Path
) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n")
    _, report = read_examples(path, family_tokenizer(architecture), max_seq_len=4096)
    assert [e.line for e in report.errors] == [1]
    assert problem in report.errors[0].reason, report.errors[0].reason


@pytest.mark.parametrize("architecture", list(CHATS))
def test_the_api_counter_counts_what_the_engine_tokenizes(architecture: str, tmp_path: Path) -> None:
    tok = family_tokenizer(architecture)
    record = conversation(architecture)
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n")
    examples, _ = read_examples(path, tok, max_seq_len=4096)
    counter = TokenCounter(tok.backend_tokenizer, tok.chat_template, tok.eos_token, tok.bos_token)
    assert counter.count("chat", record) == len(examples[0].input_ids)


def line(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode()


def with_call(**function: Any) -> dict[str, Any]:
    call = {**CALL, "function": {**CALL["function"], **function}}
    return {"messages": [ASK, {"role": "assistant", "tool_calls": [call]}], "tools": [WEATHER]}


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        (
            {
                "messages": [ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}, ANSWER],
                "tools": [WEATHER],
            },
            "messages[1].tool_call_id 'nope' answers no earlier tool call",
        ),
        (
            {"messages": [ASK, *TOOL_TURNS, TOOL_TURNS[1], ANSWER], "tools": [WEATHER]},
            "messages[3].tool_call_id 'call00001' answers a call that was answered before",
        ),
        (
            with_call(name="get_time"),
            "messages[1].tool_calls[0].function.name 'get_time' is not a tool in 'tools'",
        ),
        (
            {"messages": [ASK, {"role": "assistant", "tool_calls": [CALL]}]},
            "'get_weather' is not a tool in 'tools' (the line has no 'tools')",
        ),
        (with_call(arguments='{"city": Paris}'), "messages[1].tool_calls[0].function.arguments is not JSON"),
        (with_call(arguments='["Paris"]'), "function.arguments must be a JSON object, got list"),
        (with_call(arguments={"city": "Paris"}), "function.arguments must be a string of JSON, got dict"),
        (
            {
                **with_call(),
                "parallel_tool_calls": False,
                "messages": [ASK, {"role": "assistant", "tool_calls": [CALL, {**CALL, "id": "b"}]}],
            },
            "messages[1].tool_calls makes 2 calls but 'parallel_tool_calls' is false",
        ),
        (
            {"messages": [ASK, ANSWER], "tools": [{"type": "function", "function": {}}]},
            "tools[0].function.name",
        ),
        ({"messages": [ASK, ANSWER], "tools": {"name": "x"}}, "field 'tools' must be a list"),
        ({"messages": [ASK, {"role": "assistant"}]}, "messages[1] is missing field 'content'"),
        (
            {"messages": [{**ASK, "tool_call_id": CALL_ID}, ANSWER]},
            "'tool_call_id' is only allowed on tool messages",
        ),
    ],
)
def test_bad_function_calling_lines_name_the_field(record: dict[str, Any], problem: str) -> None:
    with pytest.raises(LineProblem) as info:
        parse_line(line(record))
    assert problem in str(info.value)


def test_a_function_calling_line_is_a_chat_example() -> None:
    parsed = parse_line(
        line({"messages": [ASK, *TOOL_TURNS, ANSWER], "tools": [WEATHER], "parallel_tool_calls": False})
    )
    assert (parsed.format, parsed.messages, parsed.assistant_messages) == ("chat", 4, 2)


# A training template whose assistant text is marked with `{% generation %}` (TRL's kind): the
# markers change nothing rendered, so the spans are found as for any template, and the counter
# renders them as transformers does.
MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_with_generation_markers(tmp_path: Path) -> None:
    tok = family_tokenizer("Qwen2ForCausalLM")
    tok.chat_template = MARKED
    record = {"messages": [SYSTEM, *GREETING, ASK, ANSWER]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n")
    examples, report = read_examples(path, tok, max_seq_len=4096)
    assert report.ok, report.errors
    trained = [t for t, label in zip(examples[0].input_ids, examples[0].labels, strict=True) if label != -100]
    assert tok.decode(trained) == "Hello!<|im_end|>\nIt is 22 C and sunny.<|im_end|>\n"
    counter = TokenCounter(tok.backend_tokenizer, tok.chat_template, tok.eos_token, tok.bos_token)
    assert counter.count("chat", record) == len(examples[0].input_ids)


@pytest.mark.parametrize("architecture", list(CHATS))
def test_serving_stops_at_the_templates_end_of_turn(architecture: str) -> None:
    """Gemma's and Phi-3's EOS ends a whole text, not a turn: a model trained on their templates
    ends a turn with '<end_of_turn>' / '<|end|>', so serving stops there too."""
    from worker.engine.data import turn_end_ids

    tok = family_tokenizer(architecture)
    turn_end = {"Gemma3ForCausalLM": "<end_of_turn>", "Phi3ForCausalLM": "<|end|>"}.get(
        architecture, tok.eos_token
    )
    assert turn_end_ids(tok) == {tok.eos_token_id, tok.convert_tokens_to_ids(turn_end)}
