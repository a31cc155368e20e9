"""Streaming `multipart/form-data` upload: the request body is parsed chunk by chunk and the file
part goes straight into the store's temp file, so memory stays flat whatever the upload's size,
and the size limit is enforced while streaming (→ 413, temp file removed).

Form fields other than the file are small text values (`purpose`); unknown fields are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import PurePosixPath, PureWindowsPath

from python_multipart.exceptions import ParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from service.errors import InsufficientStorageError, InvalidRequestError, PayloadTooLargeError
from service.storage import ObjectWriter, Store, StoredObject

MAX_FIELD_BYTES = 1024
# Multipart framing around the file: boundaries, part headers, the `purpose` field.
ENVELOPE_BYTES = 64 * 1024
MAX_FILENAME = 255
# Parsing (pure Python) and disk writes run in a worker thread a batch at a time, so a large upload
# does not hold the event loop for seconds while other requests wait.
PARSE_BATCH_BYTES = 1 << 20


@dataclass
class Upload:
    filename: str
    fields: dict[str, str]
    stored: StoredObject


@dataclass
class _PartState:
    headers: dict[str, str] = field(default_factory=dict)
    header_field: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    name: str | None = None
    filename: str | None = None
    value: bytearray = field(default_factory=bytearray)


def clean_filename(raw: str) -> str:
    """The last path component only (clients may send a full path), at most 255 characters."""
    name = PureWindowsPath(PurePosixPath(raw).name).name.strip().replace("\x00", "")
    return (name or "upload")[:MAX_FILENAME]


class _Receiver:
    def __init__(self, store: Store, key: str, allowed_fields: set[str], max_bytes: int) -> None:
        self.store = store
        self.key = key
        self.allowed_fields = allowed_fields
        self.max_bytes = max_bytes
        self.part = _PartState()
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.writer: ObjectWriter | None = None
        self.stored: StoredObject | None = None

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self.on_part_begin,
            "on_header_field": lambda d, s, e: self.part.header_field.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self.part.header_value.extend(d[s:e]),
            "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished,
            "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end,
        }

    def on_part_begin(self) -> None:
        self.part = _PartState()

    def on_header_end(self) -> None:
        name = self.part.header_field.decode("latin-1").strip().lower()
        self.part.headers[name] = self.part.header_value.decode("latin-1")
        self.part.header_field.clear()
        self.part.header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.part.headers.get("content-disposition", ""))
        name = options.get(b"name")
        if name is None:
            raise InvalidRequestError("a multipart part has no name", param="body")
        self.part.name = name.decode("utf-8", "replace")
        if b"filename" in options:
            if self.part.name != "file":
                raise InvalidRequestError(f"unexpected file field {self.part.name!r}", param=self.part.name)
            if self.writer is not None or self.stored is not None:
                raise InvalidRequestError("send exactly one 'file' part", param="file")
            self.part.filename = clean_filename(options[b"filename"].decode("utf-8", "replace"))
            self.filename = self.part.filename
            self.writer = self.store.writer(self.key, max_bytes=self.max_bytes)
        elif self.part.name not in self.allowed_fields:
            raise InvalidRequestError(f"unknown form field {self.part.name!r}", param=self.part.name)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.part.filename is not None and self.writer is not None:
            self.writer.write(data[start:end])
            return
        self.part.value.extend(data[start:end])
        if len(self.part.value) > MAX_FIELD_BYTES:
            raise InvalidRequestError(f"form field {self.part.name!r} is too long", param=self.part.name)

    def on_part_end(self) -> None:
        if self.part.filename is not None and self.writer is not None:
            self.stored = self.writer.commit()
            return
        if self.part.name is not None:
            self.fields[self.part.name] = self.part.value.decode("utf-8", "replace")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.abort()  # no-op once committed


async def receive_upload(
    request: Request, *, store: Store, key: str, allowed_fields: set[str], max_bytes: int
) -> Upload:
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise InvalidRequestError("the request must be multipart/form-data with a 'file' part", param="file")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes + ENVELOPE_BYTES:
        raise PayloadTooLargeError(f"file exceeds the upload limit of {max_bytes} bytes", param="file")

    receiver = _Receiver(store, key, allowed_fields, max_bytes)
    parser = MultipartParser(params[b"boundary"], receiver.callbacks())  # type: ignore[arg-type]
    body_bytes = 0
    pending = bytearray()  # up to PARSE_BATCH_BYTES: parsed and written in a worker thread
    try:
        async for chunk in request.stream():
            body_bytes += len(chunk)
            if body_bytes > max_bytes + ENVELOPE_BYTES:
                raise PayloadTooLargeError(
                    f"file exceeds the upload limit of {max_bytes} bytes", param="file"
                )
            pending += chunk
            if len(pending) >= PARSE_BATCH_BYTES:
                await run_in_threadpool(parser.write, bytes(pending))
                pending.clear()
        if pending:
            await run_in_threadpool(parser.write, bytes(pending))
        await run_in_threadpool(parser.finalize)  # the last part ends here: fsync + rename
    except ParseError as e:
        raise InvalidRequestError(f"malformed multipart body: {e}", param="file") from e
    except InsufficientStorageError as e:  # the temp file is gone already (ObjectWriter)
        raise InsufficientStorageError(
            f"the server's storage is full: the file was not stored ({body_bytes} bytes received); "
            "retry once space has been freed",
            param="file",
        ) from e
    finally:
        if receiver.stored is None:
            receiver.close()
    if receiver.stored is None or receiver.filename is None:
        raise InvalidRequestError("the request has no complete 'file' part", param="file")
    return Upload(filename=receiver.filename, fields=receiver.fields, stored=receiver.stored)
