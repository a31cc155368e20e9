"""How the API answers a download of a stored object (a file's content, an adapter zip): the
local file itself (a FileStore, re-hashed first), a redirect to a presigned URL (S3 with
`storage_presign_downloads`: the bytes never pass through the API), or the object streamed from
S3 through the API, hashed on the way (a mismatch cuts the response short)."""

from __future__ import annotations

from fastapi.responses import FileResponse, RedirectResponse, Response, StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from service.settings import get_settings
from service.storage import FileStore, attachment, default_store


def download_response(
    key: str, sha256: str, *, media_type: str, filename: str, size: int | None = None
) -> Response:
    """The object `key` (whose bytes must hash to `sha256`) as a download named `filename`;
    `size` where the caller's row has it (else the store is asked)."""
    store = default_store()
    if isinstance(store, FileStore):
        return FileResponse(store.verify(key, sha256), media_type=media_type, filename=filename)
    if get_settings().storage_presign_downloads:
        url = store.presigned_url(key, filename=filename, media_type=media_type)
        if url is not None:
            return RedirectResponse(url, status_code=307)
    headers = {  # FileResponse's headers: a client sees no difference between the stores
        "Content-Length": str(size if size is not None else store.size(key)),
        "Content-Disposition": attachment(filename),
    }
    return StreamingResponse(
        iterate_in_threadpool(store.iter_verified(key, sha256)), media_type=media_type, headers=headers
    )
