"""Fine-tuning datasets: OpenAI JSONL formats -> token ids + loss labels -> deterministic batches.

One JSONL file holds one format (the first valid line decides):

- chat: `{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, "weight": 0|1},
  ...], "tools": [...]}` rendered with the model's own chat template (its tool-calling format for
  `tools`, assistant `tool_calls` and `tool` results); the loss covers each weight-1 (the default)
  assistant turn as the template writes it, tool calls included, through its end-of-turn text
  (ChatML: '<|im_end|>' and a newline); tool results are context (worker/engine/chat_format.py).
- prompt/completion: `{"prompt": str, "completion": str}` as raw text, no template (OpenAI's
  legacy semantics); the loss covers the completion and an appended EOS token.
- text: `{"text": str}`; the loss covers every token, EOS appended.
- preference (DPO): `{"input": {"messages": [...], "tools": [...]}, "preferred_output": [one
  assistant message], "non_preferred_output": [one]}`. One example is the pair: the prompt rendered
  with the preferred answer (chosen), then with the other (rejected), two sequences back to back
  (`Examples.split`: where the rejected one starts); each carries loss on its answer's tokens. A
  pair is packed, held out and batched whole, so both sequences share a row (`pair_slots`).

Labels follow Hugging Face's convention: `labels[t]` is the target of the logits at `t - 1` (the
model shifts), -100 where no loss is taken. The first label of every example is -100: nothing
predicts it, and in a packed row it would otherwise be "predicted" by the previous example.

Policy: nothing is truncated or dropped silently. A line longer than `max_seq_len` is an error,
like every other bad line; `validate_dataset` reports them all with 1-based line numbers.
Blank (whitespace-only) lines are not examples and are skipped.

Memory is bounded by the file's tokens, not by Python objects per token: a file is read and
tokenized `CHUNK_LINES` at a time into flat arrays (`Examples`: 2 or 4 bytes a token id, 1 byte a
loss flag, 20 bytes an example); the held-out and trained sets are views of them, a row is a list
of example positions (`Rows`), and a batch's rows are built when the batch is drawn. A stop asked
for while this runs (`should_stop`, between chunks and while packing) raises `StopRequested`.
"""

from __future__ import annotations

import bisect
import heapq
import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, overload

import torch
from transformers import PreTrainedTokenizerBase

from worker.engine.chat_format import Render, Span, assistant_spans, end_of_turn, prompt_text
from worker.engine.dataset_rules import (
    NO_EXAMPLES,
    NO_TRAINABLE_TOKENS,
    PREFERENCE_FORMAT,
    DatasetFormat,
    FileFormat,
    LineProblem,
    check_conversation,
    parse_line,
    preference_pair,
)
from worker.engine.holdout import holdout_size
from worker.engine.training_config import AutoPlan, DataShape, batches_per_epoch
from worker.engine.types import DatasetError, LineError, ModelError, RequestError, StopRequested

IGNORE_INDEX = -100
CHUNK_LINES = 1024  # lines parsed and tokenized together; `should_stop` is asked between chunks
PACK_CHECK_EVERY = 1 << 16  # examples placed between two `should_stop` questions while packing

StopCheck = Callable[[], bool]  # `TrainingCallbacks.should_stop`: True raises StopRequested


@dataclass
class Example:
    """One tokenized line. input_ids and labels have the same length T."""

    line: int
    input_ids: list[int]
    labels: list[int]
    split: int = 0  # a preference pair: where its second (rejected) sequence starts; 0: one sequence

    @property
    def trainable_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


@dataclass
class Row:
    """One training row: a single example, or several packed ones (position_ids restart per example)."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    lines: list[int]  # source lines, in row order


@dataclass
class ValidationReport:
    format: DatasetFormat | None
    examples: int  # valid examples
    tokens: int  # tokens over valid examples
    trainable_tokens: int  # tokens that carry loss over valid examples
    max_tokens: int  # longest valid example
    errors: list[LineError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class Examples(Sequence[Example]):
    """A file's tokenized examples in flat arrays, in file order: what a run keeps in memory.

    Per token: its id (2 bytes where the vocabulary fits 16 bits, else 4) and a loss flag (1 byte);
    per example: its end offset (8 bytes), line (4) and trainable tokens (4). A Python list of ints
    would take about 36 bytes a token. `labels[t]` is `input_ids[t]` where the flag is set, else
    IGNORE_INDEX. `subset` views some of the examples without copying their tokens. A preference
    pair is one example of two sequences; `splits` (4 bytes an example) says where the second starts.
    """

    def __init__(self, vocab_size: int = 1 << 31) -> None:
        self.ids = array("H" if vocab_size <= 1 << 16 else "i")
        self.trainable = array("B")
        self.ends = array("q")  # ends[i]: offset just past example i in `ids`
        self.lines = array("i")
        self.trainable_counts = array("i")
        self.splits = array("i")  # splits[i]: offset of example i's second sequence in it (0: none)
        self.picked: array[int] | None = None  # a subset: its examples' positions in the arrays above

    @classmethod
    def of(cls, examples: Iterable[Example]) -> Examples:
        out = cls()
        for e in examples:
            out.append(e.line, e.input_ids, [label != IGNORE_INDEX for label in e.labels], e.split)
        return out

    def append(self, line: int, ids: Sequence[int], trainable: Sequence[bool], split: int = 0) -> None:
        self.splits.append(split)
        self.ids.extend(ids)
        self.trainable.extend(trainable)
        self.ends.append(len(self.ids))
        self.lines.append(line)
        self.trainable_counts.append(sum(trainable))

    def subset(self, positions: torch.Tensor) -> Examples:
        """The examples at `positions` ((k,) integer tensor, of this sequence), sharing this one's
        arrays: 4 bytes per example."""
        out = Examples.__new__(Examples)
        out.ids, out.trainable, out.ends, out.lines = self.ids, self.trainable, self.ends, self.lines
        out.trainable_counts, out.splits = self.trainable_counts, self.splits
        base = positions.long() if self.picked is None else _int64(self.picked)[positions.long()]
        out.picked = array("i", base.to(torch.int32).numpy().tobytes())
        return out

    def _at(self, i: int) -> int:
        return i if self.picked is None else self.picked[i]

    def __len__(self) -> int:
        return len(self.lines) if self.picked is None else len(self.picked)

    def _mine(self, per_example: torch.Tensor) -> torch.Tensor:
        """A per-example value of the whole arrays, (all,), as this sequence's (n,): a subset's
        examples only."""
        return per_example if self.picked is None else per_example[_int64(self.picked)]

    @overload
    def __getitem__(self, i: int) -> Example: ...
    @overload
    def __getitem__(self, i: slice) -> list[Example]: ...
    def __getitem__(self, i: int | slice) -> Example | list[Example]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        ids, labels = self.tokens_of(i % len(self))
        return Example(self.line(i % len(self)), ids, labels, self.split(i % len(self)))

    def line(self, i: int) -> int:
        return self.lines[self._at(i)]

    def split(self, i: int) -> int:
        """Where example i's second sequence starts (a preference pair's rejected one); 0: none."""
        return self.splits[self._at(i)]

    def positions(self, i: int) -> list[int]:
        """Example i's position ids: 0.. restarting where its second sequence starts."""
        a, b = self.span(i)
        cut = self.split(i)
        return [*range(cut), *range(b - a - cut)] if cut else list(range(b - a))

    def sequences_per_example(self) -> torch.Tensor:
        """(n,) int64: 2 for a preference pair, else 1."""
        counts = (_int64(self.splits) > 0).long() + 1
        return self._mine(counts)

    def span(self, i: int) -> tuple[int, int]:
        p = self._at(i)
        return (self.ends[p - 1] if p else 0), self.ends[p]

    def tokens_of(self, i: int) -> tuple[list[int], list[int]]:
        """(input_ids, labels) of example `i`."""
        a, b = self.span(i)
        ids = self.ids[a:b].tolist()
        flags = self.trainable[a:b]
        return ids, [t if f else IGNORE_INDEX for t, f in zip(ids, flags, strict=True)]

    def lengths(self) -> torch.Tensor:
        """(n,) int64: tokens of each example."""
        all_lengths = torch.diff(_int64(self.ends), prepend=torch.zeros(1, dtype=torch.int64))
        return self._mine(all_lengths)

    def attention_work(self) -> torch.Tensor:
        """(n,) int64: query-key pairs causal attention computes over each example, L(L+1)/2 per
        sequence (a preference pair's two sequences apart)."""
        lengths = self.lengths()
        cut = self._mine(_int64(self.splits))
        rest = lengths - cut
        return (cut * (cut + 1) + rest * (rest + 1)) // 2

    def trainable_per_example(self) -> torch.Tensor:
        """(n,) int64: trainable tokens of each example."""
        return self._mine(_int64(self.trainable_counts))

    @property
    def tokens(self) -> int:
        return int(self.lengths().sum())

    @property
    def trainable_tokens(self) -> int:
        return int(self.trainable_per_example().sum())

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (a subset counts its index only)."""
        if self.picked is not None:
            return len(self.picked) * self.picked.itemsize
        arrays = (self.ids, self.trainable, self.ends, self.lines, self.trainable_counts)
        return sum(len(a) * a.itemsize for a in arrays)


def _int64(values: array[int]) -> torch.Tensor:
    """An array of integers as a new (n,) int64 tensor."""
    if not values:
        return torch.zeros(0, dtype=torch.int64)
    dtype = {"q": torch.int64, "i": torch.int32}[values.typecode]
    return torch.frombuffer(values, dtype=dtype).to(torch.int64, copy=True)


@dataclass
class TokenizedDataset:
    rows: Rows
    examples: int
    tokens: int
    trainable_tokens: int
    max_seq_len: int  # a row holds at most this many tokens (the run's row_tokens when packed)
    packed: bool
    format: DatasetFormat
    pad_token_id: int

    def __len__(self) -> int:
        return len(self.rows)


class Rows(Sequence[Row]):
    """A dataset's training rows, built from its examples when asked for: row r holds the examples
    `members[starts[r]:starts[r + 1]]` (positions in `examples`, in file order), or example r alone
    when unpacked. 4 bytes per example and 8 per row besides the examples."""

    def __init__(
        self, examples: Examples, members: torch.Tensor | None = None, starts: torch.Tensor | None = None
    ) -> None:
        self.examples = examples
        self.members = members  # (n,) int32, or None: one example per row
        self.starts = starts  # (rows + 1,) int64

    def __len__(self) -> int:
        return len(self.examples) if self.starts is None else len(self.starts) - 1

    def member_positions(self, r: int) -> list[int]:
        if self.members is None or self.starts is None:
            return [r]
        return self.members[int(self.starts[r]) : int(self.starts[r + 1])].tolist()

    @overload
    def __getitem__(self, r: int) -> Row: ...
    @overload
    def __getitem__(self, r: slice) -> list[Row]: ...
    def __getitem__(self, r: int | slice) -> Row | list[Row]:
        if isinstance(r, slice):
            return [self[k] for k in range(*r.indices(len(self)))]
        if not -len(self) <= r < len(self):
            raise IndexError(r)
        row = Row([], [], [], [])
        for p in self.member_positions(r % len(self)):
            ids, labels = self.examples.tokens_of(p)
            row.input_ids += ids
            row.labels += labels
            row.position_ids += self.examples.positions(p)
            row.lines.append(self.examples.line(p))
        return row

    def _per_row(self, per_example: torch.Tensor) -> torch.Tensor:
        if self.members is None or self.starts is None:
            return per_example
        sums = torch.zeros(len(self), dtype=torch.int64)
        row_of = torch.repeat_interleave(torch.arange(len(self)), torch.diff(self.starts))
        return sums.index_add_(0, row_of, per_example[self.members.long()])

    def lengths(self) -> torch.Tensor:
        """(rows,) int64: tokens of each row."""
        return self._per_row(self.examples.lengths())

    def trainable(self) -> torch.Tensor:
        """(rows,) int64: tokens of each row that carry loss."""
        return self._per_row(self.examples.trainable_per_example())

    def attention_work(self) -> torch.Tensor:
        """(rows,) int64: query-key pairs causal attention computes over each row's real tokens
        (what `distributed.row_attention_work` counts from a collated batch)."""
        return self._per_row(self.examples.attention_work())

    def segments(self) -> torch.Tensor:
        """(rows,) int64: sequences in each row (an example's one, a preference pair's two)."""
        return self._per_row(self.examples.sequences_per_example())

    def longest(self) -> int:
        return int(self.lengths().max()) if len(self) else 0


# ---------------------------------------------------------------------------------------------
# parsing: each line by the shared rules (`dataset_rules.parse_line`) -> what to tokenize


@dataclass
class _Parsed:
    line: int
    format: DatasetFormat
    record: dict[str, Any]


# ---------------------------------------------------------------------------------------------
# tokenization


def _chat_spans(
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, tools: list[Any] | None = None
) -> tuple[str, list[Span]]:
    """Render the conversation with the model's own chat template; return the text and the
    character spans of its weight-1 assistant turns, each through the template's end-of-turn text
    (worker/engine/chat_format.py says how they are found, Qwen 3's thinking tags included)."""
    eot = _end_of_turn(tokenizer, tokenizer.chat_template)
    return assistant_spans(messages, tools or None, _renderer(tokenizer), eot)


def _renderer(tokenizer: PreTrainedTokenizerBase) -> Render:
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        out = tokenizer.apply_chat_template(
            messages, tools=list(tools or []) or None, tokenize=False, add_generation_prompt=generation
        )
        assert isinstance(out, str)
        return out

    return render


@lru_cache(maxsize=8)
def _end_of_turn(tokenizer: PreTrainedTokenizerBase, template: str) -> str:
    """The template's end-of-turn text (`template` keys the cache: a tokenizer's may be replaced)."""

    def offsets(text: str) -> list[Span]:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [(int(a), int(b)) for a, b in enc["offset_mapping"]]

    return end_of_turn(_renderer(tokenizer), offsets)


def turn_end_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The token ids that end an assistant turn when serving: EOS, and the chat template's
    end-of-turn token where it is a special token of its own (Gemma's '<end_of_turn>', Phi-3's
    '<|end|>': their EOS ends a whole text, and a model trained on the template stops at the
    turn's end)."""
    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if not tokenizer.chat_template:
        return ids
    try:
        eot = _end_of_turn(tokenizer, tokenizer.chat_template)
    except ModelError:  # a template that cannot end a turn: chat requests say so when rendered
        return ids
    first = tokenizer(eot, add_special_tokens=False)["input_ids"][:1]
    if first and first[0] in tokenizer.all_special_ids:
        ids.add(int(first[0]))
    return ids


def prompt_ids(
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase, tools: list[Any] | None = None
) -> list[int]:
    """The token ids a model is asked to continue for `messages` (serving): the chat template with
    `tools` and the generation prompt, tokenized without added special tokens, exactly as training
    renders the context of an assistant turn (`_chat_spans`)."""
    if not tokenizer.chat_template:
        raise ModelError("the model's tokenizer has no chat template, so it cannot serve chat completions")
    try:
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            check_conversation(messages, tools, needs_assistant=False)  # ids answered, names offered
        text = prompt_text(messages, tools or None, _renderer(tokenizer))
    except LineProblem as exc:
        at_tools = str(exc).startswith(
            ("field 'tools'", "tools[", "the model's chat template does not render 'tools'")
        )
        raise RequestError("tools" if at_tools else "messages", str(exc)) from exc
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Token i is trainable when its first character lies in a span. Offsets and spans are sorted."""
    out: list[bool] = []
    j = 0
    for start, _end in offsets:
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        out.append(j < len(spans) and spans[j][0] <= start < spans[j][1])
    return out


# (line, input_ids, loss flags, split: where a preference pair's rejected sequence starts, else 0)
_Tokenized = tuple[int, list[int], list[bool], int]


def _tokenize(parsed: list[_Parsed], tokenizer: PreTrainedTokenizerBase) -> list[_Tokenized | LineError]:
    """Tokenize a chunk of parsed lines in a few batched calls (the fast tokenizer is linear in the text)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DatasetError([LineError(0, "the model's tokenizer has no EOS token")])
    if any(p.format in ("chat", PREFERENCE_FORMAT) for p in parsed) and not tokenizer.chat_template:
        raise DatasetError(
            [
                LineError(
                    0, "the model's tokenizer has no chat template: use the prompt/completion or text format"
                )
            ]
        )
    results: list[_Tokenized | LineError] = []
    chat_texts: list[str] = []
    chat_spans: list[list[tuple[int, int]]] = []
    chat_index: list[int] = []  # the line of each chat text (a preference line has two, in a row)
    plain_index: list[int] = []
    for k, p in enumerate(parsed):
        results.append(LineError(p.line, "not tokenized"))  # placeholder, replaced below
        if p.format in ("chat", PREFERENCE_FORMAT):
            # a pair's prompt trains nothing (weight 0); its answer is the one trained turn
            conversations = (
                [
                    ([{**m, "weight": 0} for m in c[:-1]] + c[-1:], tools)
                    for c, tools in preference_pair(p.record)
                ]
                if p.format == PREFERENCE_FORMAT
                else [(p.record["messages"], p.record.get("tools"))]
            )
            try:
                rendered = [_chat_spans(c, tokenizer, tools) for c, tools in conversations]
            except LineProblem as exc:
                results[k] = LineError(p.line, str(exc))
                continue
            for text, spans in rendered:
                chat_texts.append(text)
                chat_spans.append(spans)
                chat_index.append(k)
        else:
            plain_index.append(k)

    if chat_texts:
        enc = tokenizer(chat_texts, add_special_tokens=False, return_offsets_mapping=True)
        for k, ids, offsets, spans in zip(
            chat_index, enc["input_ids"], enc["offset_mapping"], chat_spans, strict=True
        ):
            flags = _mask_from_spans(offsets, spans)
            flags[0] = False  # nothing predicts a sequence's first token
            done = results[k]
            if isinstance(done, tuple):  # a pair's rejected sequence: after the chosen one
                results[k] = (done[0], done[1] + list(ids), done[2] + flags, len(done[1]))
            else:
                results[k] = (parsed[k].line, list(ids), flags, 0)

    prompts = [parsed[k].record.get("prompt", "") for k in plain_index]
    bodies = [
        parsed[k].record["completion"]
        if parsed[k].format == "prompt_completion"
        else parsed[k].record["text"]
        for k in plain_index
    ]
    if plain_index:
        body_ids = tokenizer(bodies, add_special_tokens=False)["input_ids"]
        prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if any(prompts) else None
        for n, k in enumerate(plain_index):
            context = list(prompt_ids[n]) if prompt_ids is not None else []
            target = [*body_ids[n], eos]
            flags = [False] * len(context) + [True] * len(target)
            flags[0] = False  # nothing predicts the first token
            results[k] = (parsed[k].line, context + target, flags, 0)

    for k, r in enumerate(results):
        if isinstance(r, tuple) and not all(_trains(r)):
            results[k] = LineError(r[0], NO_TRAINABLE_TOKENS)
    return results


def _trains(tokenized: _Tokenized) -> list[bool]:
    """Whether each sequence of a tokenized line (a pair's two, else one) carries loss."""
    _line, _ids, flags, split = tokenized
    return [any(flags[:split]), any(flags[split:])] if split else [any(flags)]


# ---------------------------------------------------------------------------------------------
# public API


def read_examples(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    *,
    should_stop: StopCheck | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Examples, ValidationReport]:
    """Parse and tokenize every line, `CHUNK_LINES` at a time into compact arrays (`Examples`);
    return the valid examples and a report listing every bad line. `should_stop` is asked between
    chunks: True raises `StopRequested` (a cancel is honoured within a chunk, well under a second);
    `progress` is told the bytes of the file read so far after each chunk."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    path = Path(path)
    if not path.is_file():
        raise DatasetError([LineError(0, f"file {path} does not exist")])
    errors: list[LineError] = []
    examples = Examples(len(tokenizer))
    file_format = FileFormat()
    chunk: list[_Parsed] = []
    done = 0  # bytes read

    def flush() -> None:
        for r in _tokenize(chunk, tokenizer):
            if isinstance(r, LineError):
                errors.append(r)
            elif len(r[1]) > max_seq_len:
                errors.append(
                    LineError(
                        r[0],
                        f"{len(r[1])} tokens is longer than max_seq_len {max_seq_len} "
                        "(nothing is truncated: shorten or split the example, or raise max_seq_len)",
                    )
                )
            else:
                examples.append(*r)
        chunk.clear()
        if progress is not None:
            progress(done)
        if should_stop is not None and should_stop():
            raise StopRequested(f"stopped while tokenizing {path.name}")

    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            done += len(raw)
            if not raw.strip():
                continue
            try:
                line = parse_line(raw)
                file_format.check(line.format, number)
            except LineProblem as exc:
                errors.append(LineError(number, str(exc)))
                continue
            chunk.append(_Parsed(number, line.format, line.record))
            if len(chunk) == CHUNK_LINES:
                flush()
    flush()
    if not len(examples) and not errors:
        errors.append(LineError(0, NO_EXAMPLES))
    errors.sort(key=lambda e: e.line)
    report = ValidationReport(
        format=file_format.format,
        examples=len(examples),
        tokens=examples.tokens,
        trainable_tokens=examples.trainable_tokens,
        max_tokens=int(examples.lengths().max()) if len(examples) else 0,
        errors=errors,
    )
    return examples, report


def validate_dataset(path: Path, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> ValidationReport:
    return read_examples(path, tokenizer, max_seq_len)[1]


def split_holdout(examples: Examples, fraction: float, seed: int) -> tuple[Examples, Examples]:
    """(trained, held out): `holdout_size(len(examples), fraction)` examples drawn by `seed`, both
    in file order (views of `examples`: no token is copied)."""
    n = len(examples)
    k = holdout_size(n, fraction)
    held = torch.tensor(sorted(random.Random(seed).sample(range(n), k)) if k else [], dtype=torch.int64)
    if not k:
        return examples, examples.subset(held)
    kept = torch.ones(n, dtype=torch.bool)
    kept[held] = False
    return examples.subset(torch.nonzero(kept).flatten()), examples.subset(held)


def read_valid_examples(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    *,
    file_label: str = "training_file",
    should_stop: StopCheck | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Examples, DatasetFormat]:
    """A file's examples and its format; raise DatasetError listing every bad line if any line is bad."""
    examples, report = read_examples(path, tokenizer, max_seq_len, should_stop=should_stop, progress=progress)
    if report.errors:
        raise DatasetError(report.errors, file_label=file_label)
    assert report.format is not None
    return examples, report.format


def load_dataset(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    *,
    pack: bool = False,
    file_label: str = "training_file",
    should_stop: StopCheck | None = None,
) -> TokenizedDataset:
    """Tokenize a JSONL file into rows of at most max_seq_len tokens (DatasetError on bad lines)."""
    examples, fmt = read_valid_examples(
        path, tokenizer, max_seq_len, file_label=file_label, should_stop=should_stop
    )
    return _dataset(examples, tokenizer, max_seq_len, pack, fmt, should_stop)


def data_shape(examples: Examples) -> DataShape:
    lengths = examples.lengths()
    return DataShape(
        examples=len(examples),
        tokens=int(lengths.sum()),
        longest=int(lengths.max()) if len(lengths) else 0,
    )


Planner = Callable[[DataShape], AutoPlan]


@dataclass
class PlannedData:
    train: TokenizedDataset
    held_out: TokenizedDataset | None  # None when nothing is held out
    shape: DataShape  # of the trained examples
    plan: AutoPlan


def planned_datasets(
    examples: Examples,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    fmt: DatasetFormat,
    *,
    pack: bool,
    holdout: float,
    seed: int,
    planner: Planner,
    should_stop: StopCheck | None = None,
) -> PlannedData:
    """A file's valid examples as the run trains and validates on them: the seeded holdout set
    apart, the run planned from the rest (`planner`: "auto" resolved, `plan_auto`), and the rest
    formed into rows of the plan's length. A job (worker/engine/recipe.py) and its dry run
    (worker/inference.py) both come here, so the dry run's counts and plan are the job's."""
    train, valid = split_holdout(examples, holdout, seed)
    shape = data_shape(train)
    plan = planner(shape)
    trained = _dataset(train, tokenizer, plan.row_tokens, pack, fmt, should_stop)
    held = _dataset(valid, tokenizer, max_seq_len, pack, fmt, should_stop) if len(valid) else None
    return PlannedData(trained, held, shape, plan)


def _dataset(
    examples: Examples,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    pack: bool,
    fmt: DatasetFormat,
    should_stop: StopCheck | None = None,
) -> TokenizedDataset:
    rows = training_rows(examples, max_seq_len, pack=pack, should_stop=should_stop)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    assert pad is not None
    return TokenizedDataset(
        rows=rows,
        examples=len(examples),
        tokens=examples.tokens,
        trainable_tokens=examples.trainable_tokens,
        max_seq_len=max_seq_len,
        packed=pack or fmt == PREFERENCE_FORMAT,  # a pair's two sequences share its row
        format=fmt,
        pad_token_id=int(pad),
    )


def training_rows(
    examples: Examples, max_seq_len: int, *, pack: bool, should_stop: StopCheck | None = None
) -> Rows:
    """The rows a run trains on: packed (padding-free, several examples a row) or one per example."""
    return pack_examples(examples, max_seq_len, should_stop=should_stop) if pack else Rows(examples)


def pack_examples(
    examples: Examples | Sequence[Example], max_seq_len: int, *, should_stop: StopCheck | None = None
) -> Rows:
    """Best-fit decreasing bin packing into rows of at most max_seq_len tokens; deterministic.

    Examples are placed longest first (ties in file order) into the row with the least room that
    still fits them (ties: the row opened first); rows are then returned in order of their first
    example's line. Rows are kept by how much room they have left (one min-heap of row numbers per
    free-token count, and the sorted list of counts that have rows), so placing an example costs
    O(log max_seq_len), and what a row holds is one row number per example.
    """
    if not isinstance(examples, Examples):
        examples = Examples.of(examples)
    lengths = examples.lengths()
    n = len(lengths)
    order = torch.sort(lengths, descending=True, stable=True).indices
    size = array("q", lengths.numpy().tobytes())  # item access without a Python int per example kept
    row_of = array("i", bytes(4 * n))
    frees: list[int] = []  # sorted free-token counts that some open row has
    rows_with: dict[int, list[int]] = {}  # free tokens -> min-heap of the rows that have that many
    opened = 0
    for chunk_start in range(0, n, PACK_CHECK_EVERY):
        if should_stop is not None and chunk_start and should_stop():
            raise StopRequested("stopped while packing rows")
        for e in order[chunk_start : chunk_start + PACK_CHECK_EVERY].tolist():
            need = size[e]
            i = bisect.bisect_left(frees, need)
            if i < len(frees):
                free = frees[i]
                heap = rows_with[free]
                row = heapq.heappop(heap)
                if not heap:
                    del frees[i], rows_with[free]
            else:
                row, free = opened, max_seq_len
                opened += 1
            row_of[e] = row
            left = free - need
            if left not in rows_with:
                rows_with[left] = []
                bisect.insort(frees, left)
            heapq.heappush(rows_with[left], row)
    # rows in order of their first example, each row's examples in file order
    bins = torch.frombuffer(row_of, dtype=torch.int32).long() if n else torch.zeros(0, dtype=torch.int64)
    first = torch.full((opened,), n, dtype=torch.int64).scatter_reduce_(0, bins, torch.arange(n), "amin")
    rank = torch.empty(opened, dtype=torch.int64)
    rank[torch.argsort(first)] = torch.arange(opened)
    ordered = torch.sort(rank[bins], stable=True).indices
    counts = torch.bincount(rank[bins], minlength=opened)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    return Rows(examples, ordered.to(torch.int32), starts)


# ---------------------------------------------------------------------------------------------
# batching


@dataclass
class Batch:
    """Right-padded tensors, all (B, T) int64 on one device.

    attention_mask is 1 on real tokens, 0 on padding. position_ids restart at 0 for each packed
    example; on padding they continue the row (unpacked) or start a new segment (packed), so that
    padding never joins a real example's segment. Because padding is on the right and attention is
    causal, no real token attends to padding; `model_inputs()` therefore passes no 2D mask, which
    lets transformers use plain causal attention (unpacked) or its packed-sequence mask derived from
    position_ids (packed).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    packed: bool
    # (B,) int64 CPU: the dataset rows these are (`BatchSampler`); what a preference batch's
    # reference log-probabilities are looked up by (worker/engine/preference.py)
    row_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum().item())

    @property
    def num_trainable_tokens(self) -> int:
        """Tokens that carry loss (labels[:, 1:] != -100; labels[:, 0] never does)."""
        return int((self.labels != IGNORE_INDEX).sum().item())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(
            self.input_ids.to(device, non_blocking=True),
            self.labels.to(device, non_blocking=True),
            self.attention_mask.to(device, non_blocking=True),
            self.position_ids.to(device, non_blocking=True),
            self.packed,
            self.row_ids,
        )

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM's forward (labels not included).

        use_cache=False matters: with a KV cache transformers ignores position_ids when building the
        mask, so packed examples would attend to each other.
        """
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}


def collate(rows: Sequence[Row], pad_token_id: int, *, packed: bool, pad_to: int | None = None) -> Batch:
    longest = max(len(r.input_ids) for r in rows)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the batch's longest row ({longest} tokens)")
    b = len(rows)
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    labels = torch.full((b, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((b, width), dtype=torch.long)
    position_ids = torch.zeros((b, width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r.input_ids)
        # through array('q'): torch.tensor walks a list element by element (486 us for 2,048 ints
        # on a 2-core CI machine, 43 us this way), and collate runs on the host between GPU steps
        input_ids[i, :n] = _int64(array("q", r.input_ids))
        labels[i, :n] = _int64(array("q", r.labels))
        attention_mask[i, :n] = 1
        position_ids[i, :n] = _int64(array("q", r.position_ids))
        start = 0 if packed else n
        position_ids[i, n:] = torch.arange(start, start + width - n)
    return Batch(input_ids, labels, attention_mask, position_ids, packed)


class BatchSampler:
    """Deterministic, resumable batching: batch `index` of `epoch` is a pure function of (seed, epoch).

    Each epoch is a permutation of the rows drawn from torch.Generator(seed + epoch), cut into
    batches of `batch_size` (the last batch may be smaller unless drop_last). A resumed run asks for
    (epoch, index) and gets exactly the batch the interrupted run would have seen.
    """

    def __init__(
        self,
        dataset: TokenizedDataset,
        batch_size: int,
        seed: int,
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        pad_to: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if pad_to is not None and pad_to < dataset.max_seq_len:
            raise ValueError(f"pad_to={pad_to} must be >= the dataset's max_seq_len {dataset.max_seq_len}")
        if drop_last and len(dataset) < batch_size:
            raise ValueError(f"drop_last with {len(dataset)} rows < batch_size {batch_size} leaves no batch")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pad_to = pad_to
        self._order: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else batches_per_epoch(n, self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """The epoch's row order."""
        return self.order_ids(epoch).tolist()

    def order_ids(self, epoch: int) -> torch.Tensor:
        """The epoch's row order as a (rows,) int64 tensor: 8 bytes a row where a list of ints
        would take 36 (cached for the last epoch asked: batch() is called once per step)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        self._order = (epoch, order)
        return order

    def batch(self, epoch: int, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range (0..{len(self) - 1})")
        ids = self.order_ids(epoch)[index * self.batch_size : (index + 1) * self.batch_size].tolist()
        return self._collate(ids)

    def _collate(self, ids: list[int]) -> Batch:
        rows = [self.dataset.rows[i] for i in ids]
        batch = collate(rows, self.dataset.pad_token_id, packed=self.dataset.packed, pad_to=self.pad_to)
        batch.row_ids = torch.tensor(ids, dtype=torch.int64)
        return batch

    def iter_from(self, epoch: int = 0, index: int = 0) -> Iterator[tuple[int, int, Batch]]:
        """Yield (epoch, index, batch) forever, starting at (epoch, index); the caller stops it."""
        while True:
            order = self.order_ids(epoch)
            for i in range(index, len(self)):
                ids = order[i * self.batch_size : (i + 1) * self.batch_size].tolist()
                yield epoch, i, self._collate(ids)
            epoch, index = epoch + 1, 0


def pair_slots(batch: Batch) -> tuple[torch.Tensor, int]:
    """A batch of preference rows: each token's sequence slot, (B, T) int64, and the pairs it holds.

    A row holds whole pairs, each its chosen then its rejected sequence, so the real sequences of
    the batch, counted row by row, are chosen₀, rejected₀, chosen₁, ...: slot 2·pair + side (side 0
    chosen, 1 rejected). Padding is -1 (a packed row's padding tail starts a sequence of its own,
    but holds no real token)."""
    real = batch.attention_mask == 1
    starts = (batch.position_ids == 0) & real  # (B, T)
    per_row = starts.sum(dim=1)  # (B,) sequences in each row: two a pair
    before = torch.cumsum(per_row, 0) - per_row  # (B,) sequences in the rows before
    ordinal = starts.long().cumsum(dim=1) - 1 + before[:, None]  # (B, T)
    slots = torch.where(real, ordinal, torch.full_like(ordinal, -1))
    return slots, int(per_row.sum()) // 2
