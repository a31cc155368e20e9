"""Fine-tuning datasets: OpenAI JSONL formats -> token ids + loss labels -> deterministic batches.

One JSONL file holds one format (the first valid line decides):

- chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": str, "weight": 0|1}, ...]}`
  rendered with the tokenizer's chat template; the loss covers each weight-1 (the default) assistant
  turn: its content and the template's end-of-turn text (ChatML: '<|im_end|>' and a newline).
- prompt/completion: `{"prompt": str, "completion": str}` as raw text, no template (OpenAI's
  legacy semantics); the loss covers the completion and an appended EOS token.
- text: `{"text": str}`; the loss covers every token, EOS appended.

Labels follow Hugging Face's convention: `labels[t]` is the target of the logits at `t - 1` (the
model shifts), -100 where no loss is taken. The first label of every example is -100: nothing
predicts it, and in a packed row it would otherwise be "predicted" by the previous example.

Policy: nothing is truncated or dropped silently. A line longer than `max_seq_len` is an error,
like every other bad line; `validate_dataset` reports them all with 1-based line numbers.
Blank (whitespace-only) lines are not examples and are skipped.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from worker.engine.dataset_rules import (
    NO_EXAMPLES,
    NO_TRAINABLE_TOKENS,
    DatasetFormat,
    FileFormat,
    LineProblem,
    parse_line,
)
from worker.engine.holdout import holdout_size
from worker.engine.training_config import AutoPlan, DataShape, batches_per_epoch
from worker.engine.types import DatasetError, LineError, ModelError

IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized line. input_ids and labels have the same length T."""

    line: int
    input_ids: list[int]
    labels: list[int]

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


@dataclass
class TokenizedDataset:
    rows: list[Row]
    examples: int
    tokens: int
    trainable_tokens: int
    max_seq_len: int  # a row holds at most this many tokens (the run's row_tokens when packed)
    packed: bool
    format: DatasetFormat
    pad_token_id: int

    def __len__(self) -> int:
        return len(self.rows)


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
    messages: list[dict[str, Any]], tokenizer: PreTrainedTokenizerBase
) -> tuple[str, list[tuple[int, int]]]:
    """Render the conversation; return the text and the character spans of weight-1 assistant turns.

    A turn's span runs from the end of the prompt that precedes it (template rendered with
    add_generation_prompt) to the end of the conversation rendered through that turn, so it holds the
    content and the end-of-turn marker. This needs templates whose renderings of a prefix are
    prefixes of the full rendering (true for ChatML-style templates such as SmolLM2's).
    """
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    full = _render(plain, tokenizer, add_generation_prompt=False)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or msg.get("weight", 1) == 0:
            continue
        before = _render(plain[:i], tokenizer, add_generation_prompt=True)
        through = _render(plain[: i + 1], tokenizer, add_generation_prompt=False)
        if not (full.startswith(before) and full.startswith(through) and len(before) < len(through)):
            raise LineProblem(
                "the model's chat template does not render conversation prefixes as prefixes of the "
                "whole conversation, so assistant turns cannot be located"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _render(
    messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase, add_generation_prompt: bool
) -> str:
    if not messages:
        # the generation prompt of an empty conversation: render one dummy turn and cut it off
        return "" if not add_generation_prompt else _generation_prompt_only(tokenizer)
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert isinstance(out, str)
    return out


def prompt_ids(messages: list[dict[str, str]], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The token ids a model is asked to continue for `messages` (serving): the chat template with
    the generation prompt, tokenized without added special tokens, exactly as training renders
    the context of an assistant turn (`_chat_spans`)."""
    if not tokenizer.chat_template:
        raise ModelError("the model's tokenizer has no chat template, so it cannot serve chat completions")
    text = _render(messages, tokenizer, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _generation_prompt_only(tokenizer: PreTrainedTokenizerBase) -> str:
    # A conversation that starts with the assistant: what precedes its content is whatever the
    # template emits before an assistant turn (e.g. a default system prompt + "<|im_start|>assistant\n").
    marker = "\x00LORAQ\x00"
    text = tokenizer.apply_chat_template([{"role": "assistant", "content": marker}], tokenize=False)
    assert isinstance(text, str)
    return text[: text.index(marker)]


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Token i is trainable when its first character lies in a span. Offsets and spans are sorted."""
    out: list[bool] = []
    j = 0
    for start, _end in offsets:
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        out.append(j < len(spans) and spans[j][0] <= start < spans[j][1])
    return out


def _tokenize(parsed: list[_Parsed], tokenizer: PreTrainedTokenizerBase) -> list[Example | LineError]:
    """Tokenize all parsed lines in a few batched calls (the fast tokenizer is linear in the text)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DatasetError([LineError(0, "the model's tokenizer has no EOS token")])
    if any(p.format == "chat" for p in parsed) and not tokenizer.chat_template:
        raise DatasetError(
            [
                LineError(
                    0, "the model's tokenizer has no chat template: use the prompt/completion or text format"
                )
            ]
        )
    results: list[Example | LineError] = []
    chat_texts: list[str] = []
    chat_spans: list[list[tuple[int, int]]] = []
    chat_index: list[int] = []
    plain_index: list[int] = []
    for k, p in enumerate(parsed):
        results.append(LineError(p.line, "not tokenized"))  # placeholder, replaced below
        if p.format == "chat":
            try:
                text, spans = _chat_spans(p.record["messages"], tokenizer)
            except LineProblem as exc:
                results[k] = LineError(p.line, str(exc))
                continue
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
            mask = _mask_from_spans(offsets, spans)
            labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
            results[k] = Example(parsed[k].line, list(ids), labels)

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
            target = [*body_ids[n], eos]
            context = list(prompt_ids[n]) if prompt_ids is not None else []
            ids = context + target
            labels = [IGNORE_INDEX] * len(context) + target
            results[k] = Example(parsed[k].line, ids, labels)

    for k, r in enumerate(results):
        if isinstance(r, Example):
            r.labels[0] = IGNORE_INDEX  # nothing predicts the first token
            if r.trainable_tokens == 0:
                results[k] = LineError(r.line, NO_TRAINABLE_TOKENS)
    return results


# ---------------------------------------------------------------------------------------------
# public API


def read_examples(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> tuple[list[Example], ValidationReport]:
    """Parse and tokenize every line; return the valid examples and a report listing every bad line."""
    if max_seq_len < 2:
        raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
    path = Path(path)
    if not path.is_file():
        raise DatasetError([LineError(0, f"file {path} does not exist")])
    errors: list[LineError] = []
    parsed: list[_Parsed] = []
    file_format = FileFormat()
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = parse_line(raw)
                file_format.check(line.format, number)
            except LineProblem as exc:
                errors.append(LineError(number, str(exc)))
                continue
            parsed.append(_Parsed(number, line.format, line.record))

    examples: list[Example] = []
    for r in _tokenize(parsed, tokenizer):
        if isinstance(r, LineError):
            errors.append(r)
        elif len(r.input_ids) > max_seq_len:
            errors.append(
                LineError(
                    r.line,
                    f"{len(r.input_ids)} tokens is longer than max_seq_len {max_seq_len} "
                    "(nothing is truncated: shorten or split the example, or raise max_seq_len)",
                )
            )
        else:
            examples.append(r)
    if not examples and not errors:
        errors.append(LineError(0, NO_EXAMPLES))
    errors.sort(key=lambda e: e.line)
    report = ValidationReport(
        format=file_format.format,
        examples=len(examples),
        tokens=sum(len(e.input_ids) for e in examples),
        trainable_tokens=sum(e.trainable_tokens for e in examples),
        max_tokens=max((len(e.input_ids) for e in examples), default=0),
        errors=errors,
    )
    return examples, report


def validate_dataset(path: Path, tokenizer: PreTrainedTokenizerBase, max_seq_len: int) -> ValidationReport:
    return read_examples(path, tokenizer, max_seq_len)[1]


def split_holdout(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(trained, held out): `holdout_size(len(examples), fraction)` examples drawn by `seed`, both
    in file order."""
    k = holdout_size(len(examples), fraction)
    held = set(random.Random(seed).sample(range(len(examples)), k)) if k else set()
    train = [e for i, e in enumerate(examples) if i not in held]
    valid = [e for i, e in enumerate(examples) if i in held]
    return train, valid


def read_valid_examples(
    path: Path, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, *, file_label: str = "training_file"
) -> tuple[list[Example], DatasetFormat]:
    """A file's examples and its format; raise DatasetError listing every bad line if any line is bad."""
    examples, report = read_examples(path, tokenizer, max_seq_len)
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
) -> TokenizedDataset:
    """Tokenize a JSONL file into rows of at most max_seq_len tokens (DatasetError on bad lines)."""
    examples, fmt = read_valid_examples(path, tokenizer, max_seq_len, file_label=file_label)
    return _dataset(examples, tokenizer, max_seq_len, pack, fmt)


def data_shape(examples: list[Example]) -> DataShape:
    return DataShape(
        examples=len(examples),
        tokens=sum(len(e.input_ids) for e in examples),
        longest=max((len(e.input_ids) for e in examples), default=0),
    )


Planner = Callable[[DataShape], AutoPlan]


@dataclass
class PlannedData:
    train: TokenizedDataset
    held_out: TokenizedDataset | None  # None when nothing is held out
    shape: DataShape  # of the trained examples
    plan: AutoPlan


def planned_datasets(
    examples: list[Example],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    fmt: DatasetFormat,
    *,
    pack: bool,
    holdout: float,
    seed: int,
    planner: Planner,
) -> PlannedData:
    """A file's valid examples as the run trains and validates on them: the seeded holdout set
    apart, the run planned from the rest (`planner`: "auto" resolved, `plan_auto`), and the rest
    formed into rows of the plan's length. A job (worker/engine/recipe.py) and its dry run
    (worker/inference.py) both come here, so the dry run's counts and plan are the job's."""
    train, valid = split_holdout(examples, holdout, seed)
    shape = data_shape(train)
    plan = planner(shape)
    trained = _dataset(train, tokenizer, plan.row_tokens, pack, fmt)
    held = _dataset(valid, tokenizer, max_seq_len, pack, fmt) if valid else None
    return PlannedData(trained, held, shape, plan)


def _dataset(
    examples: list[Example],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    pack: bool,
    fmt: DatasetFormat,
) -> TokenizedDataset:
    rows = training_rows(examples, max_seq_len, pack=pack)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    assert pad is not None
    return TokenizedDataset(
        rows=rows,
        examples=len(examples),
        tokens=sum(len(e.input_ids) for e in examples),
        trainable_tokens=sum(e.trainable_tokens for e in examples),
        max_seq_len=max_seq_len,
        packed=pack,
        format=fmt,
        pad_token_id=int(pad),
    )


def training_rows(examples: list[Example], max_seq_len: int, *, pack: bool) -> list[Row]:
    """The rows a run trains on: packed (padding-free, several examples a row) or one per example."""
    return pack_examples(examples, max_seq_len) if pack else [_single_row(e) for e in examples]


def _single_row(e: Example) -> Row:
    return Row(list(e.input_ids), list(e.labels), list(range(len(e.input_ids))), [e.line])


def pack_examples(examples: list[Example], max_seq_len: int) -> list[Row]:
    """Best-fit decreasing bin packing into rows of at most max_seq_len tokens; deterministic.

    Examples are placed longest first (ties in file order) into the row with the least room that
    still fits them; rows are then returned in order of their first example's line.
    """
    order = sorted(examples, key=lambda e: -len(e.input_ids))  # stable: ties keep file order
    bins: list[list[Example]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, bin index)
    for e in order:
        n = len(e.input_ids)
        i = bisect.bisect_left(room, (n, -1))
        if i < len(room):
            free, b = room.pop(i)
            bins[b].append(e)
            bisect.insort(room, (free - n, b))
        else:
            bins.append([e])
            bisect.insort(room, (max_seq_len - n, len(bins) - 1))
    rows: list[Row] = []
    for members in bins:
        members.sort(key=lambda e: e.line)
        row = Row([], [], [], [])
        for e in members:
            row.input_ids += e.input_ids
            row.labels += e.labels
            row.position_ids += range(len(e.input_ids))
            row.lines.append(e.line)
        rows.append(row)
    rows.sort(key=lambda r: r.lines[0])
    return rows


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
        )

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a Hugging Face causal LM's forward (labels not included).

        use_cache=False matters: with a KV cache transformers ignores position_ids when building the
        mask, so packed examples would attend to each other.
        """
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}


def collate(rows: list[Row], pad_token_id: int, *, packed: bool, pad_to: int | None = None) -> Batch:
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
        input_ids[i, :n] = torch.tensor(r.input_ids)
        labels[i, :n] = torch.tensor(r.labels)
        attention_mask[i, :n] = 1
        position_ids[i, :n] = torch.tensor(r.position_ids)
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
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else batches_per_epoch(n, self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """The epoch's row order (cached for the last epoch asked: batch() is called once per step)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        self._order = (epoch, order)
        return order

    def batch(self, epoch: int, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range (0..{len(self) - 1})")
        ids = self.order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        rows = [self.dataset.rows[i] for i in ids]
        return collate(rows, self.dataset.pad_token_id, packed=self.dataset.packed, pad_to=self.pad_to)

    def iter_from(self, epoch: int = 0, index: int = 0) -> Iterator[tuple[int, int, Batch]]:
        """Yield (epoch, index, batch) forever, starting at (epoch, index); the caller stops it."""
        while True:
            order = self.order(epoch)
            for i in range(index, len(self)):
                ids = order[i * self.batch_size : (i + 1) * self.batch_size]
                rows = [self.dataset.rows[j] for j in ids]
                yield (
                    epoch,
                    i,
                    collate(rows, self.dataset.pad_token_id, packed=self.dataset.packed, pad_to=self.pad_to),
                )
            epoch, index = epoch + 1, 0
