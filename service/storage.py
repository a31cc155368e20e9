"""The artifact and dataset store: objects keyed by relative paths such as
`files/<tenant>/<file id>` or `jobs/<job id>/attempt-<n>/adapter.zip`, behind one interface
(`Store`) with two implementations: a directory tree (`FileStore`, the default: `<data_dir>/store`)
and an S3-compatible bucket (`service/storage_s3.py`, `LORAQ_STORAGE_URL=s3://bucket/prefix`).

Writes stream through an `ObjectWriter` that hashes (sha256) and counts the bytes as they pass,
enforces a size limit while streaming, and publishes the object whole or not at all: a temp file
renamed into place (FileStore), a multipart upload completed at `commit()` (S3). Leaving the block
without `commit()` removes what was written, and so does a full disk (`InsufficientStorageError`,
which the API answers 507). Reads re-check the sha256 recorded in the database. Keys come from our
own rows, never from a request, and are still checked to stay inside the root.

Code that needs a local file (a dataset the worker tokenizes, a zip it unpacks) asks
`materialize(key)`: the file itself in a FileStore, a bounded, hash-checked cache on this host for
S3. A checkpoint is published with a manifest written after its zip (`put_checkpoint`); readers
trust only a checkpoint whose manifest names it, and check its bytes against it
(`checkpoint_sha256`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from service.errors import DISK_FULL_ERRNOS, InsufficientStorageError, PayloadTooLargeError, StorageError
from service.settings import get_settings
from worker.engine.atomic_files import AtomicFile, file_sha256

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


def check_key(key: str) -> list[str]:
    """The components of `key` ("a/b/c"); refuses empty, absolute, "." and ".." components."""
    parts = key.split("/")
    if any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts):
        raise StorageError(f"invalid storage key {key!r}")
    return parts


def attachment(filename: str) -> str:
    """A Content-Disposition that names `filename`, as Starlette's FileResponse writes it."""
    quoted = quote(filename)
    if quoted != filename:
        return f"attachment; filename*=utf-8''{quoted}"
    return f'attachment; filename="{filename}"'


def sha256_mismatch(key: str) -> StorageError:
    return StorageError(f"stored object {key} failed its sha256 check")


class ObjectWriter(ABC):
    """Streams bytes into a store while hashing and counting them; `commit()` publishes the object.

    Used as a context manager: leaving the block without `commit()` (an error, a size-limit hit)
    discards what was written, so nothing partial is left in the store.
    """

    def __init__(self, key: str, max_bytes: int | None) -> None:
        self.key = key
        self.max_bytes = max_bytes
        self.size = 0
        self._hash = hashlib.sha256()
        self._done = False

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.max_bytes is not None and self.size > self.max_bytes:
            self.abort()
            raise PayloadTooLargeError(
                f"file exceeds the upload limit of {self.max_bytes} bytes", param="file"
            )
        self._hash.update(chunk)
        self._write(chunk)

    def commit(self) -> StoredObject:
        self._publish()
        self._done = True
        return StoredObject(self.key, self._hash.hexdigest(), self.size)

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._discard()

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()  # no-op after commit()

    @abstractmethod
    def _write(self, chunk: bytes) -> None: ...

    @abstractmethod
    def _publish(self) -> None:
        """Make the written bytes the object `key`, whole, in one step."""

    @abstractmethod
    def _discard(self) -> None:
        """Remove what was written; never raises."""


class Store(ABC):
    """What the service needs of a store. Objects are immutable once published (keys carry ids and
    attempts), which is what lets `materialize` cache them by key."""

    @abstractmethod
    def writer(self, key: str, *, max_bytes: int | None = None) -> ObjectWriter: ...

    @abstractmethod
    def chunks(self, key: str) -> Iterator[bytes]:
        """The object's bytes as they are read; `FileNotFoundError` if it does not exist."""

    @abstractmethod
    def iter_verified(self, key: str, sha256: str) -> Iterator[bytes]:
        """The object's bytes, raising `StorageError` if they do not match `sha256`: before the
        first chunk where the whole object is cheap to read first (a local file), else before the
        last one (so a response that streams them ends short and never completes)."""

    @abstractmethod
    def materialize(self, key: str, sha256: str | None = None) -> Path:
        """A local file with the object's bytes (checked against `sha256` when given). A FileStore
        returns the object's own file; S3 a file in this host's bounded cache, which may evict it
        once later objects need the space: open it soon, read it as long as needed."""

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing one is not an error."""

    @abstractmethod
    def delete_tree(self, prefix: str) -> None:
        """Remove every object under `prefix/`."""

    @abstractmethod
    def lock_path(self, key: str) -> Path:
        """A local file for an advisory lock about `key`, shared by the processes that share this
        store's files (FileStore: beside the object; S3: this host's cache directory)."""

    @abstractmethod
    def presigned_url(self, key: str, *, filename: str, media_type: str) -> str | None:
        """A time-limited URL that lets a client GET the object straight from the store, or None
        where the store has none (a local directory)."""

    @abstractmethod
    def sweep_partials(self, older_than_s: float) -> int:
        """Remove what writers killed mid-write left behind (older than `older_than_s`: another
        live process may be writing a newer one); return how many."""

    # -- built on the above
    def put_bytes(self, key: str, data: bytes) -> StoredObject:
        with self.writer(key) as w:
            w.write(data)
            return w.commit()

    def put_file(self, src: Path, key: str) -> StoredObject:
        with self.writer(key) as w, src.open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                w.write(chunk)
            return w.commit()

    def put_dir_zip(self, directory: Path, key: str, *, scratch: Path | None = None) -> StoredObject:
        """Zip `directory`'s files (paths relative to it, sorted) into the object `key`; the zip
        is built in `scratch` (default: beside `directory`), then streamed to the store."""
        if not directory.is_dir():
            raise StorageError(f"{directory} is not a directory")
        with (
            disk_space_for(f"zip {directory.name}"),
            tempfile.TemporaryDirectory(dir=scratch or directory.parent) as tmp,
        ):
            archive = Path(tmp) / "archive.zip"
            with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
                for file in sorted(p for p in directory.rglob("*") if p.is_file()):
                    zf.write(file, file.relative_to(directory).as_posix())
            return self.put_file(archive, key)

    def get_bytes(self, key: str) -> bytes:
        """A small object whole (a manifest, token counts); `FileNotFoundError` if missing."""
        return b"".join(self.chunks(key))

    def extract_zip(self, key: str, dest: Path, sha256: str | None = None) -> Path:
        """Unpack a zip object into `dest`, refusing members that would land outside it."""
        dest.mkdir(parents=True, exist_ok=True)
        root = dest.resolve()
        with zipfile.ZipFile(self.materialize(key, sha256)) as zf:
            for member in zf.namelist():
                target = (root / member).resolve()
                if not target.is_relative_to(root):
                    raise StorageError(f"zip object {key} has an unsafe member {member!r}")
            with disk_space_for(f"unpack {key}"):
                zf.extractall(root)
        return root


# ---------------------------------------------------------------- a directory tree


class FileWriter(ObjectWriter):
    """Bytes go to a temp file in the destination's directory; commit is fsync + rename
    (worker/engine/atomic_files.py)."""

    def __init__(self, store: FileStore, key: str, max_bytes: int | None) -> None:
        super().__init__(key, max_bytes)
        self.path = store.path(key)
        with disk_space_for("store an object"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = AtomicFile(self.path)

    def _write(self, chunk: bytes) -> None:
        with self._aborted_if_full():
            self._file.write(chunk)

    def _publish(self) -> None:
        with self._aborted_if_full():
            self._file.commit()

    @contextlib.contextmanager
    def _aborted_if_full(self) -> Iterator[None]:
        """A full disk removes the temp file at once: what was written of it is space back."""
        try:
            with disk_space_for(f"store {self.size} bytes"):
                yield
        except InsufficientStorageError:
            self.abort()
            raise

    def _discard(self) -> None:
        self._file.discard()


class FileStore(Store):
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, key: str) -> Path:
        """The file for `key`."""
        return self.root.joinpath(*check_key(key))

    def writer(self, key: str, *, max_bytes: int | None = None) -> ObjectWriter:
        return FileWriter(self, key, max_bytes)

    def chunks(self, key: str) -> Iterator[bytes]:
        with self.path(key).open("rb") as fh:
            while chunk := fh.read(CHUNK_BYTES):
                yield chunk

    def put_dir_zip(self, directory: Path, key: str, *, scratch: Path | None = None) -> StoredObject:
        # the zip is built on the store's own filesystem: a full store fails before the rename
        own = self.root if self.root.is_dir() else None
        return super().put_dir_zip(directory, key, scratch=scratch or own)

    def size(self, key: str) -> int:
        return self.path(key).stat().st_size

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def verify(self, key: str, sha256: str) -> Path:
        """Re-hash the object; raise `StorageError` when it is missing or its bytes changed."""
        path = self.path(key)
        if not path.is_file():
            raise StorageError(f"stored object {key} is missing")
        if file_sha256(path) != sha256:
            raise sha256_mismatch(key)
        return path

    def iter_verified(self, key: str, sha256: str) -> Iterator[bytes]:
        self.verify(key, sha256)  # a corrupt object sends nothing
        return self.chunks(key)

    def materialize(self, key: str, sha256: str | None = None) -> Path:
        if sha256 is not None:
            return self.verify(key, sha256)
        path = self.path(key)
        if not path.is_file():
            raise StorageError(f"stored object {key} is missing")
        return path

    def lock_path(self, key: str) -> Path:
        return self.path(key)

    def presigned_url(self, key: str, *, filename: str, media_type: str) -> str | None:
        return None

    def sweep_partials(self, older_than_s: float) -> int:
        """Remove temp files (`*.part`) a killed process left behind."""
        if not self.root.is_dir():
            return 0
        return sweep_part_files(self.root, older_than_s)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.path(prefix), ignore_errors=True)


def sweep_part_files(root: Path, older_than_s: float) -> int:
    """Remove the temp files (`.<name>.<random>.part`) under `root` untouched for `older_than_s`."""
    cutoff = time.time() - older_than_s
    removed = 0
    # os.walk, not rglob: a directory that a worker removes during the walk (a job's scratch
    # dir) is skipped by os.walk, where rglob raised FileNotFoundError and failed the API's start
    for directory, _dirs, files in os.walk(root):
        for name in files:
            if not (name.startswith(".") and name.endswith(".part")):
                continue
            part = Path(directory) / name
            with contextlib.suppress(FileNotFoundError):
                if part.stat().st_mtime < cutoff:
                    part.unlink()
                    removed += 1
    return removed


# ---------------------------------------------------------------- checkpoints: the zip, then its manifest


def manifest_key(key: str) -> str:
    return f"{key}.manifest.json"


def put_checkpoint(store: Store, directory: Path, key: str, *, step: int) -> StoredObject:
    """Publish a checkpoint: its zip first, then the manifest that names the zip's sha256 and
    size. A writer killed before the manifest leaves a checkpoint nobody reads."""
    stored = store.put_dir_zip(directory, key)
    manifest = {"object": stored.key, "sha256": stored.sha256, "bytes": stored.size, "step": step}
    try:
        store.put_bytes(manifest_key(key), json.dumps(manifest, sort_keys=True).encode())
    except Exception:  # a full disk, a store gone: the zip nobody will trust goes too, if it can
        with contextlib.suppress(Exception):
            store.delete(key)
        raise
    return stored


def checkpoint_sha256(store: Store, key: str) -> str | None:
    """The sha256 that the checkpoint `key`'s manifest gives its zip; None without a manifest
    (a writer stopped before it finished), or with one that names another object."""
    try:
        manifest = json.loads(store.get_bytes(manifest_key(key)))
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("object") != key:
        return None
    sha256 = manifest.get("sha256")
    return sha256 if isinstance(sha256, str) else None


# ---------------------------------------------------------------- the default store (from settings)


def default_store() -> Store:
    """The store `LORAQ_STORAGE_URL` names: unset, the directory `<data_dir>/store`."""
    settings = get_settings()
    if settings.storage_url is None:
        return FileStore(settings.artifact_dir)
    from service.storage_s3 import S3Config, s3_store

    return s3_store(S3Config.from_settings(settings))


def put_bytes(key: str, data: bytes) -> StoredObject:
    return default_store().put_bytes(key, data)


def file_key(tenant_id: str, file_id: str) -> str:
    return f"files/{tenant_id}/{file_id}"
