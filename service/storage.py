"""The artifact and dataset store: a directory tree under `settings.artifact_dir`, keyed by
relative paths such as `files/<tenant>/<file id>` or `jobs/<job id>/adapter.zip`.

Writes are atomic: bytes go to a temp file in the same directory while their sha256 is computed,
then fsync + rename, so a reader (or a restarted API) never sees a half-written object. A size
limit is enforced while streaming; exceeding it deletes the temp file, and so does a full disk
(`InsufficientStorageError`, which the API answers 507). Reads re-check the
sha256 recorded in the database. Keys come from our own rows, never from a request, and are
still checked to stay inside the root.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from service.errors import DISK_FULL_ERRNOS, InsufficientStorageError, PayloadTooLargeError, StorageError
from service.settings import get_settings

CHUNK_BYTES = 1 << 20


@contextlib.contextmanager
def disk_space_for(what: str) -> Iterator[None]:
    """A write in the block that finds the disk full raises `InsufficientStorageError` naming `what`."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL_ERRNOS:
            raise
        raise InsufficientStorageError(f"no space left on the server's storage to {what}") from e


@dataclass(frozen=True)
class StoredObject:
    key: str
    sha256: str
    size: int


class ObjectWriter:
    """Streams bytes into a temp file next to the destination; `commit()` publishes it.

    Used as a context manager: leaving the block without `commit()` (an error, a size-limit hit)
    removes the temp file, so nothing partial is left in the store.
    """

    def __init__(self, store: FileStore, key: str, max_bytes: int | None) -> None:
        self.key = key
        self.path = store.path(key)
        self.max_bytes = max_bytes
        self.size = 0
        self._hash = hashlib.sha256()
        with disk_space_for("store an object"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".part", dir=self.path.parent)
        self._tmp = Path(tmp)
        self._fh = os.fdopen(fd, "wb")
        self._done = False

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            self.abort()
            raise PayloadTooLargeError(
                f"file exceeds the upload limit of {self.max_bytes} bytes", param="file"
            )
        self._hash.update(chunk)
        with self._aborted_if_full():
            self._fh.write(chunk)

    def commit(self) -> StoredObject:
        with self._aborted_if_full():
            self._fh.flush()
            os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.path)
        _fsync_dir(self.path.parent)
        self._done = True
        return StoredObject(self.key, self._hash.hexdigest(), self.size)

    @contextlib.contextmanager
    def _aborted_if_full(self) -> Iterator[None]:
        """A full disk removes the temp file at once: what was written of it is space back."""
        try:
            with disk_space_for(f"store {self.size} bytes"):
                yield
        except InsufficientStorageError:
            self.abort()
            raise

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):  # on a full disk closing fails to flush: the file goes anyway
            self._fh.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()  # no-op after commit()


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, key: str) -> Path:
        """The file for `key` ("a/b/c"); refuses empty, absolute, "." and ".." components."""
        parts = key.split("/")
        if any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
            raise StorageError(f"invalid storage key {key!r}")
        return self.root.joinpath(*parts)

    def writer(self, key: str, *, max_bytes: int | None = None) -> ObjectWriter:
        return ObjectWriter(self, key, max_bytes)

    def put_bytes(self, key: str, data: bytes) -> StoredObject:
        with self.writer(key) as w:
            w.write(data)
            return w.commit()

    def put_file(self, src: Path, key: str) -> StoredObject:
        with self.writer(key) as w, src.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                w.write(chunk)
            return w.commit()

    def put_dir_zip(self, directory: Path, key: str) -> StoredObject:
        """Zip `directory`'s files (paths relative to it, sorted) into the object `key`."""
        if not directory.is_dir():
            raise StorageError(f"{directory} is not a directory")
        with (
            disk_space_for(f"zip {directory.name}"),
            tempfile.TemporaryDirectory(dir=self.root if self.root.is_dir() else None) as tmp,
        ):
            archive = Path(tmp) / "archive.zip"
            with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                for file in sorted(p for p in directory.rglob("*") if p.is_file()):
                    zf.write(file, file.relative_to(directory).as_posix())
            return self.put_file(archive, key)

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def verify(self, key: str, sha256: str) -> Path:
        """Re-hash the object; raise `StorageError` when it is missing or its bytes changed."""
        path = self.path(key)
        if not path.is_file():
            raise StorageError(f"stored object {key} is missing")
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                digest.update(chunk)
        if digest.hexdigest() != sha256:
            raise StorageError(f"stored object {key} failed its sha256 check")
        return path

    def iter_verified(self, key: str, sha256: str) -> Iterator[bytes]:
        """Stream the object after checking its sha256 (so a corrupt object sends nothing)."""
        path = self.verify(key, sha256)
        with path.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                yield chunk

    def extract_zip(self, key: str, dest: Path) -> Path:
        """Unpack a zip object into `dest`, refusing members that would land outside it."""
        dest.mkdir(parents=True, exist_ok=True)
        root = dest.resolve()
        with zipfile.ZipFile(self.path(key)) as zf:
            for member in zf.namelist():
                target = (root / member).resolve()
                if not target.is_relative_to(root):
                    raise StorageError(f"zip object {key} has an unsafe member {member!r}")
            with disk_space_for(f"unpack {key}"):
                zf.extractall(root)
        return root

    def sweep_partials(self, older_than_s: float) -> int:
        """Remove temp files (`*.part`) a killed process left behind; return how many.

        Only files untouched for `older_than_s`: another live process may be writing a newer one.
        """
        if not self.root.is_dir():
            return 0
        cutoff = time.time() - older_than_s
        removed = 0
        # os.walk, not rglob: a directory that a worker removes during the walk (a job's scratch
        # dir) is skipped by os.walk, where rglob raised FileNotFoundError and failed the API's start
        for directory, _dirs, files in os.walk(self.root):
            for name in files:
                if not (name.startswith(".") and name.endswith(".part")):
                    continue
                part = Path(directory) / name
                with contextlib.suppress(FileNotFoundError):
                    if part.stat().st_mtime < cutoff:
                        part.unlink()
                        removed += 1
        return removed

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.path(prefix), ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the default store (from settings)


def default_store() -> FileStore:
    return FileStore(get_settings().artifact_dir)


def local_path(key: str) -> Path:
    return default_store().path(key)


def put_bytes(key: str, data: bytes) -> StoredObject:
    return default_store().put_bytes(key, data)


def put_dir_zip(directory: Path, key: str) -> StoredObject:
    return default_store().put_dir_zip(directory, key)


def extract_zip(key: str, dest: Path) -> Path:
    return default_store().extract_zip(key, dest)


def file_key(tenant_id: str, file_id: str) -> str:
    return f"files/{tenant_id}/{file_id}"
