"""The store in an S3-compatible bucket (`LORAQ_STORAGE_URL=s3://bucket/prefix`), through boto3.

- Writes are multipart uploads: chunks collect until they make `storage_part_bytes`, each such
  part goes up, and `commit()` completes the upload, which publishes the object whole (an object
  smaller than one part is a single PUT). A writer holds about two parts at its peak (the chunks
  and the part joined from them, then botocore's request), whatever the object's size. An aborted
  or killed writer leaves no object, only an unfinished upload that `sweep_partials` aborts once
  it is old.
- Reads stream the object's body; `iter_verified` hashes as it streams and holds the last chunk
  back until the hash matched, so a corrupt object never makes a complete response.
- `materialize` downloads into this host's cache (`<data_dir>/cache/store/<key>`): temp file,
  sha256 checked, renamed into place; a hit is re-hashed when a sha256 is given (as a FileStore
  read is). Past `storage_cache_bytes`, the least recently used files are evicted.
- Botocore errors become `StorageError` (500) naming the key; a missing object is
  `FileNotFoundError`, as a FileStore's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from service.errors import StorageError
from service.settings import Settings
from service.storage import (
    CHUNK_BYTES,
    ObjectWriter,
    Store,
    attachment,
    check_key,
    disk_space_for,
    file_sha256,
    sha256_mismatch,
    sweep_part_files,
)
from worker.engine.atomic_files import AtomicFile

MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


@dataclass(frozen=True)
class S3Config:
    bucket: str
    prefix: str  # "" or "some/prefix/"
    endpoint_url: str | None
    region: str | None
    access_key_id: str | None
    secret_access_key: str | None
    addressing_style: str
    part_bytes: int
    cache_dir: Path
    cache_bytes: int
    presign_seconds: int
    public_endpoint_url: str | None = None  # presigned URLs' host; None: endpoint_url's

    @classmethod
    def from_settings(cls, settings: Settings) -> S3Config:
        url = settings.storage_url
        if url is None or not url.startswith("s3://"):
            raise StorageError(f"LORAQ_STORAGE_URL must be s3://bucket/prefix, not {url!r}")
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        prefix = prefix.strip("/")
        return cls(
            bucket=bucket,
            prefix=f"{prefix}/" if prefix else "",
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            access_key_id=settings.s3_access_key_id,
            secret_access_key=settings.s3_secret_access_key,
            addressing_style=settings.s3_addressing_style,
            part_bytes=settings.storage_part_bytes,
            cache_dir=settings.storage_cache_dir,
            cache_bytes=settings.storage_cache_bytes,
            presign_seconds=settings.storage_presign_seconds,
            public_endpoint_url=settings.s3_public_endpoint_url,
        )


@lru_cache(maxsize=4)
def s3_store(config: S3Config) -> S3Store:
    """One store (and boto3 client: tens of ms to build, thread-safe) per configuration."""
    return S3Store(config)


def _client(config: S3Config) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3",
        endpoint_url=config.endpoint_url,  # None: boto3's own (AWS_ENDPOINT_URL, else AWS)
        region_name=config.region,
        aws_access_key_id=config.access_key_id,
        aws_secret_access_key=config.secret_access_key,
        config=Config(
            s3={"addressing_style": config.addressing_style},
            retries={"mode": "standard", "max_attempts": 5},
            connect_timeout=5,
            read_timeout=60,
            max_pool_connections=32,
        ),
    )


@contextlib.contextmanager
def s3_errors(what: str, key: str = "") -> Iterator[None]:
    """Botocore's errors as ours: a missing object `key` is `FileNotFoundError`, anything else a
    `StorageError` that says what failed."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in MISSING_CODES:
            raise FileNotFoundError(f"stored object {key or what} is missing") from e
        raise StorageError(f"object storage failed to {what}: {code or e}") from e
    except BotoCoreError as e:
        raise StorageError(f"object storage failed to {what}: {e}") from e


class S3Writer(ObjectWriter):
    def __init__(self, store: S3Store, key: str, max_bytes: int | None) -> None:
        super().__init__(key, max_bytes)
        self.store = store
        self.name = store.name(key)
        # the chunks of the part being filled: joined once they reach `part_bytes` (a part is that
        # plus at most one chunk), then dropped, so a writer holds about two parts at its peak
        self._chunks: list[bytes] = []
        self.buffered = 0
        self._upload_id: str | None = None
        self._parts: list[dict[str, Any]] = []

    def _write(self, chunk: bytes) -> None:
        self._chunks.append(bytes(chunk))
        self.buffered += len(chunk)
        if self.buffered >= self.store.config.part_bytes:
            self._send_part(self._take())

    def _take(self) -> bytes:
        body = b"".join(self._chunks)
        self._chunks, self.buffered = [], 0
        return body

    def _send_part(self, body: bytes) -> None:
        client, bucket = self.store.client, self.store.config.bucket
        with self._aborted_on_error(f"upload part {len(self._parts) + 1} of {self.key}"):
            if self._upload_id is None:
                self._upload_id = client.create_multipart_upload(Bucket=bucket, Key=self.name)["UploadId"]
            number = len(self._parts) + 1
            answer = client.upload_part(
                Bucket=bucket, Key=self.name, UploadId=self._upload_id, PartNumber=number, Body=body
            )
        self._parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    def _publish(self) -> None:
        client, bucket = self.store.client, self.store.config.bucket
        if self._upload_id is None:  # smaller than one part: one PUT
            with self._aborted_on_error(f"store {self.key}"):
                client.put_object(Bucket=bucket, Key=self.name, Body=self._take())
            return
        if self.buffered:
            self._send_part(self._take())  # the last part may be short
        with self._aborted_on_error(f"complete {self.key}"):
            client.complete_multipart_upload(
                Bucket=bucket, Key=self.name, UploadId=self._upload_id, MultipartUpload={"Parts": self._parts}
            )

    @contextlib.contextmanager
    def _aborted_on_error(self, what: str) -> Iterator[None]:
        try:
            with s3_errors(what):
                yield
        except BaseException:
            self.abort()
            raise

    def _discard(self) -> None:
        self._chunks, self.buffered = [], 0
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # an unreachable store: sweep_partials aborts it later
                self.store.client.abort_multipart_upload(
                    Bucket=self.store.config.bucket, Key=self.name, UploadId=self._upload_id
                )


class S3Store(Store):
    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.client = _client(config)
        # signs download URLs for the address the API's clients reach (no request goes through it)
        public = config.public_endpoint_url
        self.presign_client = (
            self.client
            if public in (None, config.endpoint_url)
            else _client(replace(config, endpoint_url=public))
        )

    def name(self, key: str) -> str:
        """The bucket's key for our `key`: under the configured prefix."""
        check_key(key)
        return self.config.prefix + key

    def writer(self, key: str, *, max_bytes: int | None = None) -> ObjectWriter:
        return S3Writer(self, key, max_bytes)

    def chunks(self, key: str) -> Iterator[bytes]:
        with s3_errors(f"read {key}", key):
            body = self.client.get_object(Bucket=self.config.bucket, Key=self.name(key))["Body"]
        try:
            with s3_errors(f"read {key}", key):
                yield from body.iter_chunks(CHUNK_BYTES)
        finally:
            body.close()

    def iter_verified(self, key: str, sha256: str) -> Iterator[bytes]:
        """Each chunk is passed on once the next one has been read, and the last one only after
        the hash matched: a response streaming a corrupt object ends short of its length."""
        digest = hashlib.sha256()
        held = b""
        for chunk in self.chunks(key):
            digest.update(chunk)
            if held:
                yield held
            held = chunk
        if digest.hexdigest() != sha256:
            raise sha256_mismatch(key)
        if held:
            yield held

    def size(self, key: str) -> int:
        with s3_errors(f"read the size of {key}", key):
            head = self.client.head_object(Bucket=self.config.bucket, Key=self.name(key))
        return int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except FileNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        with s3_errors(f"delete {key}"):
            self.client.delete_object(Bucket=self.config.bucket, Key=self.name(key))

    def delete_tree(self, prefix: str) -> None:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.config.bucket, Prefix=self.name(prefix) + "/"
        )
        with s3_errors(f"delete {prefix}/"):
            for page in pages:
                names = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if names:  # at most 1000 a page, as DeleteObjects takes
                    self.client.delete_objects(Bucket=self.config.bucket, Delete={"Objects": names})

    def presigned_url(self, key: str, *, filename: str, media_type: str) -> str:
        params = {
            "Bucket": self.config.bucket,
            "Key": self.name(key),
            "ResponseContentDisposition": attachment(filename),
            "ResponseContentType": media_type,
        }
        with s3_errors(f"sign a URL for {key}"):
            url: str = self.presign_client.generate_presigned_url(
                "get_object", Params=params, ExpiresIn=self.config.presign_seconds
            )
        return url

    def sweep_partials(self, older_than_s: float) -> int:
        """Abort the unfinished multipart uploads under our prefix started over `older_than_s` ago
        (their parts cost storage until then), and the cache's temp files."""
        cutoff = time.time() - older_than_s
        aborted = 0
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.config.bucket, Prefix=self.config.prefix
        )
        with s3_errors("list unfinished uploads"):
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"].timestamp() < cutoff:
                        self.client.abort_multipart_upload(
                            Bucket=self.config.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        if self.config.cache_dir.is_dir():
            aborted += sweep_part_files(self.config.cache_dir, older_than_s)
        return aborted

    # -- this host's cache
    def cache_path(self, key: str) -> Path:
        return self.config.cache_dir.joinpath(*check_key(key))

    def lock_path(self, key: str) -> Path:
        # beside the cache, not in it: eviction must never remove a file someone holds a lock on
        return self.config.cache_dir.parent.joinpath("locks", *check_key(key))

    def materialize(self, key: str, sha256: str | None = None) -> Path:
        path = self.cache_path(key)
        if path.is_file() and (sha256 is None or file_sha256(path) == sha256):
            with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: fetched again below
                os.utime(path)  # most recently used
                return path
        with disk_space_for(f"cache {key}"):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with AtomicFile(path) as cached:
                    for chunk in self.chunks(key):
                        cached.write(chunk)
                    if sha256 is not None and cached.sha256() != sha256:
                        raise sha256_mismatch(key)
                    cached.commit()
            except FileNotFoundError as e:  # the object's, as a FileStore says it
                raise StorageError(f"stored object {key} is missing") from e
        self._evict(keep=path)
        return path

    def _evict(self, *, keep: Path) -> None:
        """Remove the least recently used cached files until the cache fits `cache_bytes`."""
        files: list[tuple[float, int, Path]] = []
        for directory, _dirs, names in os.walk(self.config.cache_dir):
            for name in names:
                path = Path(directory) / name
                if name.endswith(".part") or path == keep:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    st = path.stat()
                    files.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in files) + keep.stat().st_size
        for _, size, path in sorted(files):
            if total <= self.config.cache_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
