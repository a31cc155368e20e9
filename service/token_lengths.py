"""Token lengths of a file's examples under a model's tokenizer, for the `max_seq_len` check of a
job's files. Counted once per (file, tokenizer) and stored beside the file.

Counting reads the stored file line by line (within `max_line_bytes`) and uses the torch-free
counter (`worker.engine.token_count`: `tokenizers` and jinja2), so the API process never loads
torch (`tokenizers` is a control-plane dependency: the API image has it). It costs about as much
as the worker's own tokenization (minutes for a 512 MB file on 2 cores), so a submit counts only
within `submit_count_seconds`; a larger file is counted by a process of its own while its job is
`validating_files` (service/file_validation.py).

The counts of a file live in the store under its derived key (`files.derived_key`), one object
per tokenizer (`TokenCounter.fingerprint`): 8 bytes per example (line number, tokens; 24 MB for
3 million lines). A process keeps the last ones it read in memory, at most `CACHE_BYTES`, least
recently used first out. A lock file beside them says a process is counting them now.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service import storage
from service.api.dataset_summary import ParsedLine, example_lines
from service.db.models import File
from service.files import derived_key
from service.settings import get_settings

if TYPE_CHECKING:
    from worker.engine.token_count import TokenCounter  # tokenizers: imported when counting

CACHE_BYTES = 64 * 1024 * 1024
LINES_SHOWN = 3
BATCH_LINES = 512  # lines tokenized in one call (and how often a deadline is looked at)
SEEN_LINES_BYTES = 16 * 1024 * 1024  # lines remembered with their count while a file is counted
# No submit counts a file larger than its time allows at this rate (measured: 1-2 MB/s a core).
FASTEST_COUNT_BYTES_PER_S = 8 * 1024 * 1024
_MAGIC = b"LQTL1\n"


@dataclass(frozen=True)
class Lengths:
    lines: array[int]  # array("I"): 1-based line numbers
    tokens: array[int]  # array("I"): tokens of that line's example

    @property
    def nbytes(self) -> int:
        return (len(self.lines) + len(self.tokens)) * 4

    def over(self, max_seq_len: int) -> list[tuple[int, int]]:
        """(line, tokens) of the examples longer than `max_seq_len`, in file order."""
        return [(ln, t) for ln, t in zip(self.lines, self.tokens, strict=True) if t > max_seq_len]

    def to_bytes(self) -> bytes:
        return _MAGIC + struct.pack("<Q", len(self.lines)) + self.lines.tobytes() + self.tokens.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> Lengths:
        if not data.startswith(_MAGIC):
            raise ValueError("not a token-lengths object")
        start = len(_MAGIC) + 8
        (n,) = struct.unpack_from("<Q", data, len(_MAGIC))
        lines, tokens = array("I"), array("I")
        lines.frombytes(data[start : start + 4 * n])
        tokens.frombytes(data[start + 4 * n : start + 8 * n])
        if len(tokens) != n:
            raise ValueError("truncated token-lengths object")
        return cls(lines, tokens)


_cache: OrderedDict[tuple[str, str], Lengths] = OrderedDict()
_cached_bytes = 0
_lock = threading.Lock()


def counter_for(model: str) -> TokenCounter | None:
    """The model's torch-free counter; None where its tokenizer is not available without torch
    (then the worker's validation is the only check)."""
    from worker.engine.token_count import load_counter  # tokenizers + jinja2, no torch

    return load_counter(model, get_settings().model_store)


def lengths_key(file: File, counter: TokenCounter) -> str:
    return f"{derived_key(file.storage_key)}/token-lengths-{counter.fingerprint}"


def stored(file: File, counter: TokenCounter) -> Lengths | None:
    """The file's counts under `counter` if they were counted before (by any process), else None."""
    key = (file.storage_key, counter.fingerprint)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    try:
        found = Lengths.from_bytes(storage.default_store().get_bytes(lengths_key(file, counter)))
    except (FileNotFoundError, ValueError):  # not counted yet (a torn object cannot be: writes are atomic)
        return None
    _remember(key, found)
    return found


def count(file: File, counter: TokenCounter, *, seconds: float | None = None) -> Lengths | None:
    """Count the file's examples and store the counts; None if that would take over `seconds`
    (a file too large to try, or one that ran out of time: nothing is stored then).

    A line whose exact bytes came before is not parsed or tokenized again: it has the same count
    (`SEEN_LINES_BYTES` of such lines are remembered, first come first kept).
    """
    if seconds is not None and file.bytes > seconds * FASTEST_COUNT_BYTES_PER_S:
        return None
    deadline = None if seconds is None else time.monotonic() + seconds
    max_line_bytes = get_settings().max_line_bytes
    result = Lengths(array("I"), array("I"))
    seen: dict[bytes, int | None] = {}
    seen_bytes = 0
    batch: list[tuple[int, bytes, ParsedLine | None]] = []  # in file order; None: a line seen before

    def flush() -> None:
        nonlocal seen_bytes
        new = [(p.format, p.record) for _, _, p in batch if p is not None]
        counted = iter(counter.count_all(new))
        for line, raw, parsed in batch:
            n = next(counted) if parsed is not None else seen[raw]
            if n is not None:
                result.lines.append(line)
                result.tokens.append(n)
            if parsed is not None and raw not in seen and seen_bytes + len(raw) <= SEEN_LINES_BYTES:
                seen[raw] = n
                seen_bytes += len(raw)
        batch.clear()

    path = storage.default_store().materialize(file.storage_key, file.sha256)
    for item in example_lines(path, max_line_bytes, seen):
        batch.append(item)
        if len(batch) == BATCH_LINES:
            flush()
            if deadline is not None and time.monotonic() > deadline:
                return None
    flush()
    storage.put_bytes(lengths_key(file, counter), result.to_bytes())
    _remember((file.storage_key, counter.fingerprint), result)
    return result


def lengths_now(file: File, counter: TokenCounter, *, seconds: float) -> Lengths | None:
    """The stored counts, or counted now if that takes under `seconds` and no other process is
    counting them; None otherwise (the job waits in `validating_files`)."""
    found = stored(file, counter)
    if found is None and not being_counted(file, counter):
        found = count(file, counter, seconds=seconds)
    return found


def _remember(key: tuple[str, str], found: Lengths) -> None:
    global _cached_bytes
    if found.nbytes > CACHE_BYTES:
        return
    with _lock:
        if key not in _cache:
            _cache[key] = found
            _cached_bytes += found.nbytes
        while _cached_bytes > CACHE_BYTES:
            _, dropped = _cache.popitem(last=False)
            _cached_bytes -= dropped.nbytes


@contextlib.contextmanager
def counting(file: File, counter: TokenCounter) -> Iterator[None]:
    """Held while this process counts the file (an exclusive lock on a file beside the counts;
    the kernel releases it when the process ends, however it ends). Waits for another holder."""
    path = storage.default_store().lock_path(lengths_key(file, counter) + ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def being_counted(file: File, counter: TokenCounter) -> bool:
    """Whether some process holds `counting` for these counts now."""
    path = storage.default_store().lock_path(lengths_key(file, counter) + ".lock")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def too_long_message(file_param: str, found: Lengths, max_seq_len: int) -> str | None:
    """Why `max_seq_len` leaves examples of this file untrainable, in words; None if none is."""
    if max(found.tokens, default=0) <= max_seq_len:  # most checks: one pass in C
        return None
    over = found.over(max_seq_len)
    shown = ", ".join(f"line {ln}: {t} tokens" for ln, t in over[:LINES_SHOWN])
    more = f", and {len(over) - LINES_SHOWN} more" if len(over) > LINES_SHOWN else ""
    longest = max(t for _, t in over)
    kept = len(found.tokens) - len(over)
    return (
        f"invalid max_seq_len: {len(over)} of the {len(found.tokens)} examples in {file_param} are "
        f"longer than max_seq_len {max_seq_len} ({shown}{more}) and {kept} would be left to train on; "
        f"nothing is truncated: raise max_seq_len to at least {longest} or shorten those examples"
    )
