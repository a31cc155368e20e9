"""`/v1/files`: upload (streamed), list, retrieve, content, delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, Response

from service import files
from service.api.dataset_summary import check_file, status_details
from service.api.downloads import download_response
from service.auth import CurrentTenant
from service.db.models import File
from service.db.session import SessionDep
from service.schemas import (
    DATABASE_UNAVAILABLE,
    DISK_FULL,
    FileDeleted,
    FilePublic,
    FilesPublic,
    error_responses,
)
from service.settings import get_settings
from service.storage import default_store
from service.uploads import receive_upload

router = APIRouter(
    prefix="/v1/files",
    tags=["files"],
    responses={**error_responses(400, 401, 404, 409, 413, 429, 500), **DATABASE_UNAVAILABLE},
)

UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file", "purpose"],
                    "additionalProperties": False,
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": list(files.UPLOAD_PURPOSES)},
                    },
                }
            }
        },
    }
}


def file_public(row: File) -> FilePublic:
    return FilePublic(
        id=row.id,
        bytes=row.bytes,
        created_at=row.created_at,
        filename=row.filename,
        purpose=row.purpose,
        status=row.status,
        status_details=row.status_details,
    )


@router.post("", response_model=FilePublic, openapi_extra=UPLOAD_BODY, responses=DISK_FULL)
async def upload_file(request: Request, tenant: CurrentTenant, session: SessionDep) -> FilePublic:
    file_id = files.new_file_id()
    upload = await receive_upload(
        request,
        store=default_store(),
        key=files.upload_key(tenant.id, file_id),
        allowed_fields={"purpose"},
        max_bytes=get_settings().max_upload_bytes,
    )
    try:
        purpose = files.check_upload_purpose(upload.fields.get("purpose"))

        def record() -> File:
            # Validated now, streaming line by line with bounded memory: a job on a
            # file with bad lines is refused at submit, naming them, instead of failing later.
            path = default_store().materialize(upload.stored.key, upload.stored.sha256)
            summary = check_file(path, get_settings().max_line_bytes)
            row = files.create_file(
                session,
                tenant_id=tenant.id,
                file_id=file_id,
                filename=upload.filename,
                purpose=purpose,
                stored=upload.stored,
                status_details=status_details(summary),
                summary=summary.to_dict(),  # the dashboard's summary: never parsed again
            )
            session.commit()
            return row

        row = await run_in_threadpool(record)
    except BaseException:
        default_store().delete(upload.stored.key)  # no row: the object must not linger
        raise
    return file_public(row)


@router.get("", response_model=FilesPublic)
def list_files(
    tenant: CurrentTenant,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    purpose: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> FilesPublic:
    rows, has_more = files.list_files(
        session, tenant_id=tenant.id, after=after, limit=limit, purpose=purpose, order=order
    )
    data = [file_public(r) for r in rows]
    return FilesPublic(
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{file_id}", response_model=FilePublic)
def retrieve_file(file_id: str, tenant: CurrentTenant, session: SessionDep) -> FilePublic:
    return file_public(files.get_file(session, tenant_id=tenant.id, file_id=file_id))


@router.get(
    "/{file_id}/content",
    response_class=FileResponse,
    # uploads come back as bytes; a job's results file (purpose fine-tune-results) as text/csv
    responses={200: {"content": {"application/octet-stream": {}, "text/csv": {}}}},
)
def file_content(file_id: str, tenant: CurrentTenant, session: SessionDep) -> Response:
    row = files.get_file(session, tenant_id=tenant.id, file_id=file_id)
    media = "text/csv" if row.purpose == "fine-tune-results" else "application/octet-stream"
    return download_response(
        row.storage_key, row.sha256, media_type=media, filename=row.filename, size=row.bytes
    )


@router.delete("/{file_id}", response_model=FileDeleted, responses=DISK_FULL)
def delete_file(file_id: str, tenant: CurrentTenant, session: SessionDep) -> FileDeleted:
    files.delete_file(session, default_store(), tenant_id=tenant.id, file_id=file_id)
    return FileDeleted(id=file_id, deleted=True)
