"""Token lengths of a file's examples under a model's tokenizer, for the submit-time
`max_seq_len` check. Computed once per (file, model) and cached in bounded memory.

Counting reads the stored file line by line (within `max_line_bytes`) and uses the torch-free
counter (`worker.engine.token_count`: `tokenizers` and jinja2), so the API process never loads
torch (`tokenizers` is a control-plane dependency: the API image has it). Each cached entry is
two arrays of 4-byte integers (line numbers, lengths); the cache holds at most
`CACHE_BYTES`, least recently used first out; an entry larger than that is not kept.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from service import storage
from service.api.dataset_summary import examples
from service.db.models import File
from service.settings import get_settings

CACHE_BYTES = 64 * 1024 * 1024
LINES_SHOWN = 3


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


_cache: OrderedDict[tuple[str, str], Lengths] = OrderedDict()
_cached_bytes = 0
_lock = threading.Lock()


def lengths(file: File, model: str) -> Lengths | None:
    """The file's example lengths under `model`'s tokenizer; None where that cannot be counted
    without torch (then the worker's validation is the only check)."""
    global _cached_bytes
    key = (file.sha256, model)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    from worker.engine.token_count import load_counter  # tokenizers + jinja2, no torch

    settings = get_settings()
    counter = load_counter(model, settings.model_store)
    if counter is None:
        return None
    result = Lengths(array("I"), array("I"))
    for line, fmt, record in examples(storage.local_path(file.storage_key), settings.max_line_bytes):
        n = counter.count(fmt, record)
        if n is not None:
            result.lines.append(line)
            result.tokens.append(n)
    if result.nbytes <= CACHE_BYTES:
        with _lock:
            if key not in _cache:
                _cache[key] = result
                _cached_bytes += result.nbytes
            while _cached_bytes > CACHE_BYTES:
                _, dropped = _cache.popitem(last=False)
                _cached_bytes -= dropped.nbytes
    return result


def too_long_message(file_param: str, found: Lengths, max_seq_len: int) -> str | None:
    """Why `max_seq_len` leaves examples of this file untrainable, in words; None if none is."""
    over = found.over(max_seq_len)
    if not over:
        return None
    shown = ", ".join(f"line {ln}: {t} tokens" for ln, t in over[:LINES_SHOWN])
    more = f", and {len(over) - LINES_SHOWN} more" if len(over) > LINES_SHOWN else ""
    longest = max(t for _, t in over)
    kept = len(found.tokens) - len(over)
    return (
        f"invalid max_seq_len: {len(over)} of the {len(found.tokens)} examples in {file_param} are "
        f"longer than max_seq_len {max_seq_len} ({shown}{more}) and {kept} would be left to train on; "
        f"nothing is truncated: raise max_seq_len to at least {longest} or shorten those examples"
    )
