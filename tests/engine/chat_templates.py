"""Each family's published chat template, as its instruct model's tokenizer_config.json carries it,
and a tokenizer that renders with it: tiny-llama's BPE plus the family's special tokens.

The templates are data, tests/engine/templates/*.jinja, copied verbatim (nothing can be pulled
from the Hub here): the blocks Qwen 3's and Qwen 2.5's templates share are the vendor's own, kept
as published rather than factored, so each file is the text its model ships.

Sources: Qwen/Qwen3-0.6B (the Qwen 3 template: tools, `<tool_call>`, `<think>` blocks kept on the
last turn only), Qwen/Qwen2.5-7B-Instruct (Qwen2ForCausalLM), meta-llama/Llama-3.1-8B-Instruct (as
Llama-3.3-70B-Instruct's: tools in the first user turn, JSON calls with "parameters"),
mistralai/Mistral-Nemo-Instruct-2407 (MistralForCausalLM: [AVAILABLE_TOOLS] before the last user
turn, [TOOL_CALLS], 9-character call ids, the system message in the last user turn),
google/gemma-3-*-it (turns `<start_of_turn>user|model`, no tools) and
microsoft/Phi-3.5-mini-instruct (no tools; EOS after the last turn). The Qwen 3, Llama, Mistral and
Phi templates are llama.cpp's copies in models/templates/; Gemma 3's is the one in its processor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from worker.engine.tiny import build_tiny_tokenizer

TEMPLATES = Path(__file__).with_name("templates")


def template(name: str) -> str:
    """A published template as its source has it (read untouched: no newline added or dropped)."""
    with (TEMPLATES / name).open(newline="") as f:
        return f.read()


@dataclass(frozen=True)
class FamilyChat:
    template: str
    special: tuple[str, ...]  # control tokens (one id each, skipped when decoding)
    plain: tuple[str, ...]  # added tokens decoded as text (Qwen's <tool_call>, <think>)
    bos: str | None
    eos: str
    tools: bool  # the template renders tools and tool calls


QWEN_PLAIN = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
CHATS: dict[str, FamilyChat] = {
    "Qwen3ForCausalLM": FamilyChat(
        template("qwen3.jinja"), ("<|im_start|>", "<|im_end|>"), QWEN_PLAIN, None, "<|im_end|>", True
    ),
    "Qwen2ForCausalLM": FamilyChat(
        template("qwen2.5.jinja"), ("<|im_start|>", "<|im_end|>"), QWEN_PLAIN[:2], None, "<|im_end|>", True
    ),
    "LlamaForCausalLM": FamilyChat(
        template("llama3.1.jinja"),
        (
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        (),
        "<|begin_of_text|>",
        "<|eot_id|>",
        True,
    ),
    "MistralForCausalLM": FamilyChat(
        template("mistral-nemo.jinja"),
        (
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        (),
        "<s>",
        "</s>",
        True,
    ),
    "Gemma3ForCausalLM": FamilyChat(
        template("gemma3.jinja"),
        ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"),
        (),
        "<bos>",
        "<eos>",
        False,
    ),
    "Phi3ForCausalLM": FamilyChat(
        template("phi3.5.jinja"),
        ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"),
        (),
        None,
        "<|endoftext|>",
        False,
    ),
}


def family_tokenizer(architecture: str) -> PreTrainedTokenizerFast:
    """tiny-llama's tokenizer with the family's chat template and tokens (at most 519 ids)."""
    chat = CHATS[architecture]
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(chat.special)})
    tok.add_tokens(list(chat.plain))
    tok.eos_token = chat.eos
    tok.bos_token = chat.bos
    tok.chat_template = chat.template
    return tok
