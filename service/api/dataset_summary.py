"""A torch-free structural check of a JSONL dataset, for the upload's status and summary.

Each line is checked by the rules the engine loads datasets with (`worker.engine.dataset_rules`,
pure Python): a JSON object in one of three formats -- chat (`messages`), `prompt` + `completion`,
or `text` -- and every line of a file in the format of its first good line.
Token counts are an estimate (UTF-8 bytes / 4): the exact count needs the model's tokenizer, which
only the worker loads; the worker re-validates every line, with the tokenizer, when the job runs.

Bounded: a line's byte length is checked before it is read whole (`bounded_lines`), and (by the
rules) its nesting depth and integer sizes before `json.loads` builds anything, so no line costs
more than `max_line_bytes` of memory or a RecursionError/ValueError deep in the parser.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from worker.engine.dataset_rules import NO_EXAMPLES, FileFormat, LineProblem, ParsedLine, parse_line

BYTES_PER_TOKEN_ESTIMATE = 4
MAX_BAD_LINES_SHOWN = 50
READ_CHUNK = 1 << 20  # an oversized line is skipped in pieces of this size


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


def summarize(lines: Iterable[bytes | int], max_line_bytes: int | None = None) -> DatasetSummary:
    """Check every line; count examples and estimated tokens; list bad lines with their numbers.

    An int in `lines` is the length of a line `bounded_lines` skipped as longer than `max_line_bytes`.
    """
    summary = DatasetSummary(format=None)
    file_format = FileFormat()

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
            parsed = parse_line(raw)
            file_format.check(parsed.format, number)
        except LineProblem as exc:
            bad(number, str(exc))
            continue
        summary.format = file_format.format
        tokens = -(-parsed.text_bytes // BYTES_PER_TOKEN_ESTIMATE)  # ceil
        summary.examples += 1
        summary.messages += parsed.messages
        summary.assistant_messages += parsed.assistant_messages
        summary.tokens += tokens
        summary.max_example_tokens = max(summary.max_example_tokens, tokens)
    if summary.examples == 0 and summary.bad_line_count == 0:
        bad(0, NO_EXAMPLES)
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


def example_lines(
    path: Path, max_line_bytes: int, known: Container[bytes] = ()
) -> Iterator[tuple[int, bytes, ParsedLine | None]]:
    """(line number, bytes, parsed) of each line of a file that can be an example, read as
    `check_file` reads it; `parsed` is None for a line whose bytes are in `known` (not parsed
    again). Lines the rules refuse are left out."""
    with path.open("rb") as fh:
        for number, raw in enumerate(bounded_lines(fh, max_line_bytes), start=1):
            if isinstance(raw, int) or not raw.strip():
                continue
            if raw in known:
                yield number, raw, None
                continue
            try:
                yield number, raw, parse_line(raw)
            except LineProblem:
                continue
