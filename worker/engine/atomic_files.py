"""Local files replaced whole or not at all, and their sha256.

Pure Python (os, tempfile, hashlib): the engine (a pulled GGUF, the model registry, a Hub model's
marker) and the control plane's stores (service/storage.py, service/storage_s3.py; the import
contract allows it) write through `AtomicFile`, so a reader sees the old file or the new one,
never part of one. Bytes go to a temp file in the target's directory (`.<name>.<random>.part`: a
rename within one file system is atomic; `service.storage.sweep_part_files` removes what a killed
process left), hashed as they pass; `commit()` fsyncs it, renames it over the target and fsyncs
the directory, so the rename survives a crash too. Leaving the `with` block without `commit()`
removes the temp file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from types import TracebackType

CHUNK_BYTES = 1 << 20


class AtomicFile:
    """A temp file beside `path` that `commit()` puts in its place. `mode`: the file's permission
    bits (mkstemp creates 0600, private to this user), e.g. 0o644 for a file other users read."""

    def __init__(self, path: Path, *, mode: int | None = None) -> None:
        self.path = path
        self.mode = mode
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
        self.tmp = Path(tmp)
        self._fh = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        self._fh.write(data)
        self._hash.update(data)
        self.size += len(data)

    def sha256(self) -> str:
        """The sha256 (hex) of the bytes written so far."""
        return self._hash.hexdigest()

    def commit(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        if self.mode is not None:
            self.tmp.chmod(self.mode)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        """Remove the temp file (nothing once committed)."""
        with contextlib.suppress(OSError):  # on a full disk closing fails to flush: the file goes anyway
            self._fh.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> AtomicFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()


def write_atomic(path: Path, data: bytes | str, *, mode: int | None = None) -> None:
    """`path` replaced by `data` (str: UTF-8) whole, as `AtomicFile` does."""
    with AtomicFile(path, mode=mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.commit()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
