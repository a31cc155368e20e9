"""prometheus_client's multiprocess files, with their disk blocks allocated before they are mapped.

prometheus_client's `MmapedDict` sizes its file with `truncate` (a sparse file: no blocks yet) and
maps it; the kernel allocates a block when a write first touches its page. On a full disk that
allocation fails, and a failed page fault in a shared mapping is SIGBUS: a worker whose disk
filled up died of it at the next new series (a job ending with a new `outcome`, one histogram key
per bucket). Here every page is allocated (`posix_fallocate`) before it is mapped, so a full disk
is an OSError (ENOSPC) from the metric call, which the worker's metric hooks log and swallow
(worker/metrics/job_hooks.py), and the process lives on.

This leans on `MmapedDict`'s private layout (`_capacity`, `_used`, `_f`, `_init_value`, the entry
format): tests/worker/test_disk_full.py fills a real filesystem under it and fails if it changes.
"""

from __future__ import annotations

import os

from prometheus_client import mmap_dict


class AllocatedMmapedDict(mmap_dict.MmapedDict):
    def __init__(self, filename: str, read_mode: bool = False) -> None:
        if not read_mode:
            allocate_new_file(filename, mmap_dict._INITIAL_MMAP_SIZE)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        # The capacity MmapedDict grows to (doubling) for this entry, allocated before it maps it.
        encoded = key.encode("utf-8")
        entry = 4 + len(encoded) + (8 - (len(encoded) + 4) % 8) + 16  # length, padded key, 2 doubles
        capacity = self._capacity
        while self._used + entry > capacity:
            capacity *= 2
        if capacity > self._capacity:
            os.posix_fallocate(self._f.fileno(), 0, capacity)
        super()._init_value(key)


def allocate_new_file(filename: str, size: int) -> None:
    """Create `filename` with `size` allocated bytes, unless it exists with data already. A full
    disk raises ENOSPC and leaves the file empty, as if it had not been created."""
    with open(filename, "a+b") as f:
        if os.fstat(f.fileno()).st_size > 0:
            return
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError:
            f.truncate(0)  # a partial allocation must not pass for a file of that size
            raise


def install() -> None:
    """Make prometheus_client's multiprocess values use `AllocatedMmapedDict` from now on."""
    from prometheus_client import values

    values.MmapedDict = AllocatedMmapedDict  # type: ignore[misc]
