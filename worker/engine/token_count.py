"""Token counts without torch or transformers, for the API's submit-time `max_seq_len` check.

The engine (`worker/engine/data.py`) tokenizes with transformers' tokenizer; this module builds the
same tokenizer from the `tokenizers` library alone and renders chat templates with jinja2 the way
transformers does, so `TokenCounter.count` equals the engine's `len(input_ids)` for a line
(tests/engine/test_token_count.py checks it on every format):

- chat: the rendered conversation, tokenized without special-token additions;
- prompt/completion: prompt tokens + completion tokens + EOS;
- text: text tokens + EOS;
- preference (DPO): the prompt rendered with each answer, both conversations' tokens (one row holds both).

A pulled GGUF model is counted with the `tokenizer.json` (and chat template) that transformers
converted from the GGUF and the worker wrote in its directory (`worker/engine/gguf_tokenizer.py`). A model
without one yet (not pulled) gets no counter (`load_counter` returns None): the API then skips the
check and the worker's validation decides.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from worker.engine.catalog import PRESET_SHAPES, PRETRAINED, TINY_LLAMA_SHAPE, get_model_info
from worker.engine.chat_format import template_messages
from worker.engine.dataset_rules import preference_pair
from worker.engine.gguf_tokenizer import tokenizer_dir
from worker.engine.types import ModelError

TINY_CORPUS = Path(__file__).with_name("tiny_corpus.txt")
# Ids 0..3, in this order (the trainer assigns special tokens first).
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
TINY_EOS = "<|im_end|>"
# ChatML; `add_generation_prompt` opens an assistant turn. Each turn ends with "<|im_end|>\n";
# the assistant's "<|im_end|>" is what it must learn to emit to stop.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tiny_tokenizer() -> Tokenizer:
    """tiny-llama's byte-level BPE (256 bytes + 4 specials + merges), trained on the shipped corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_LLAMA_SHAPE.vocab_size,
        min_frequency=2,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS.read_text().splitlines(), trainer=trainer)
    return tok


@dataclass(frozen=True)
class TokenCounter:
    tokenizer: Tokenizer
    chat_template: str | None
    eos_token: str | None
    bos_token: str | None = None

    @cached_property
    def fingerprint(self) -> str:
        """Names what the counts depend on (the tokenizer, its chat template and special tokens):
        counts stored under one fingerprint are never read with another tokenizer."""
        digest = hashlib.sha256(self.tokenizer.to_str().encode())
        for part in (self.chat_template, self.eos_token, self.bos_token):
            digest.update(b"\x00" + (part or "").encode())
        return digest.hexdigest()[:32]

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def count(self, fmt: str, record: dict[str, Any]) -> int | None:
        """Tokens of one valid line as the engine builds it; None if this counter cannot tell
        (a chat line and no chat template, or a template that fails to render it)."""
        return self.count_all([(fmt, record)])[0]

    def count_all(self, lines: Sequence[tuple[str, dict[str, Any]]]) -> list[int | None]:
        """`count` of each (format, record), tokenized in one batch: the tokenizer encodes a batch on
        its own threads without holding the GIL.

        - chat: the rendered conversation;
        - prompt/completion: prompt + completion + EOS (tokenized apart, as the engine does);
        - text: text + EOS;
        - preference: the prompt with the preferred answer + the prompt with the other one.
        """
        texts: list[str] = []
        # per line: (index of its first text, how many texts, tokens added), None if uncountable
        parts: list[tuple[int, int, int] | None] = []
        for fmt, record in lines:
            if fmt == "chat":
                text = self.render(record["messages"], record.get("tools"))
                parts.append(None if text is None else (len(texts), 1, 0))
                if text is not None:
                    texts.append(text)
            elif fmt == "preference":
                pair = [self.render(conversation, tools) for conversation, tools in preference_pair(record)]
                rendered = [t for t in pair if t is not None]
                parts.append((len(texts), 2, 0) if len(rendered) == 2 else None)
                texts += rendered if len(rendered) == 2 else []
            elif fmt == "prompt_completion":
                parts.append((len(texts), 2, 1))
                texts += [record.get("prompt", ""), record["completion"]]
            else:
                parts.append((len(texts), 1, 1))
                texts.append(record["text"])
        encoded = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False) if texts else []
        sizes = [len(e) for e in encoded]
        return [None if p is None else sum(sizes[p[0] : p[0] + p[1]]) + p[2] for p in parts]

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str | None:
        if self.chat_template is None:
            return None
        plain = template_messages(messages)  # as the engine hands them to the template
        try:
            return _template(self.chat_template).render(
                messages=plain,
                tools=tools or None,  # as transformers: always given, None without tools
                add_generation_prompt=False,
                eos_token=self.eos_token,
                bos_token=self.bos_token,
                raise_exception=_raise,
                strftime_now=lambda fmt: datetime.now().strftime(fmt),
            )
        except Exception:  # a template error: the worker's validation reports it
            return None


def _raise(message: str) -> None:
    raise ValueError(message)


@lru_cache(maxsize=8)
def _template(source: str) -> Any:
    # As transformers compiles chat templates: sandboxed, trim_blocks and lstrip_blocks, and a
    # `{% generation %}` block (training templates mark assistant text with it) renders its body.
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012  (jinja2 declares it a set)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_directory(directory: Path) -> TokenCounter | None:
    file = directory / "tokenizer.json"
    try:
        written = file.stat().st_mtime_ns
    except FileNotFoundError:  # not cached: the worker may write it later (a pull, a first load)
        return None
    return _read_directory(directory, written)


@lru_cache(maxsize=4)
def _read_directory(directory: Path, written: int) -> TokenCounter:
    """The counter from a directory's tokenizer files; `written` (tokenizer.json's mtime) keys the
    cache, so files written again are read again."""
    file = directory / "tokenizer.json"
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template")
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text()
    if not isinstance(template, str):
        template = None
    return TokenCounter(
        Tokenizer.from_file(str(file)),
        template,
        _token_text(config.get("eos_token")),
        _token_text(config.get("bos_token")),
    )


@lru_cache(maxsize=1)
def _tiny_counter() -> TokenCounter:
    return TokenCounter(train_tiny_tokenizer(), TINY_CHAT_TEMPLATE, TINY_EOS)


def load_counter(model: str, store: Path) -> TokenCounter | None:
    """The counter for a catalog model, or None where its tokenizer is not available torch-free."""
    if model in PRESET_SHAPES:  # tiny-llama and the benchmark presets share tiny-llama's tokenizer
        return _tiny_counter()
    if model in PRETRAINED:  # a GGUF: its tokenizer files are written at pull (pull.py) or load
        return _from_directory(tokenizer_dir(store / model))
    try:
        info = get_model_info(model, store)
    except ModelError:
        return None
    return _from_directory(Path(info.path)) if info.path else None
