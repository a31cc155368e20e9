"""Files of a tenant: uploaded datasets (`fine-tune`) and job results (`fine-tune-results`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import File, Job, is_id, new_id
from service.errors import ConflictError, InvalidRequestError, NotFoundError
from service.job_status import UNFINISHED
from service.settings import get_settings
from service.storage import Store, StoredObject, default_store, file_key, put_bytes

UPLOAD_PURPOSES = ("fine-tune",)
ALL_PURPOSES = ("fine-tune", "fine-tune-results")


def new_file_id() -> str:
    return new_id("file")


def upload_key(tenant_id: str, file_id: str) -> str:
    return file_key(tenant_id, file_id)


def derived_key(storage_key: str) -> str:
    """Where what is computed from a stored file once (its token counts per tokenizer) is kept:
    a folder beside it, deleted with it."""
    return f"{storage_key}.derived"


def check_upload_purpose(purpose: str | None) -> str:
    if not purpose:
        raise InvalidRequestError("missing required form field 'purpose'", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequestError(
            f"invalid purpose {purpose!r}: supported purposes are {', '.join(UPLOAD_PURPOSES)}",
            param="purpose",
        )
    return purpose


def create_file(
    session: Session,
    *,
    tenant_id: str,
    file_id: str,
    filename: str,
    purpose: str,
    stored: StoredObject,
    status_details: str | None = None,
    summary: dict[str, Any] | None = None,
) -> File:
    """Record an object already published in the store (so a visible row always has its bytes).
    `status_details` set: the file failed validation (`status` "error", as OpenAI's Files API);
    `summary`: the upload's check of it (`DatasetSummary.to_dict`), served by the dashboard."""
    row = File(
        id=file_id,
        tenant_id=tenant_id,
        purpose=purpose,
        filename=filename,
        bytes=stored.size,
        sha256=stored.sha256,
        storage_key=stored.key,
        status="processed" if status_details is None else "error",
        status_details=status_details,
        summary=summary,
    )
    session.add(row)
    session.flush()
    return row


def create_file_from_bytes(
    session: Session, *, tenant_id: str, filename: str, purpose: str, content: bytes
) -> File:
    """Store `content` under a new file id, then record it (create_file)."""
    file_id = new_file_id()
    stored = put_bytes(file_key(tenant_id, file_id), content)
    return create_file(
        session, tenant_id=tenant_id, file_id=file_id, filename=filename, purpose=purpose, stored=stored
    )


def get_file(session: Session, *, tenant_id: str, file_id: str) -> File:
    row = (
        session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id))
        if is_id(file_id)
        else None
    )
    if row is None:
        raise NotFoundError(f"No such File object: {file_id}", param="file_id")
    return row


def stored_summary(session: Session, row: File) -> dict[str, Any]:
    """The file's structural check (`DatasetSummary.to_dict`) as its upload stored it; a file
    stored before summaries were is checked now, once, and its summary stored."""
    if row.summary is None:
        from service.api.dataset_summary import check_file

        path = default_store().materialize(row.storage_key, row.sha256)
        row.summary = check_file(path, get_settings().max_line_bytes).to_dict()
        session.flush()  # stored with the request's commit
    return row.summary


def list_files(
    session: Session, *, tenant_id: str, after: str | None, limit: int, purpose: str | None, order: str
) -> tuple[list[File], bool]:
    query = select(File).where(File.tenant_id == tenant_id)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    if after is not None:
        cursor = (
            session.scalar(select(File.seq).where(File.id == after, File.tenant_id == tenant_id))
            if is_id(after)
            else None
        )
        if cursor is None:
            raise NotFoundError(f"unknown file id {after!r} in 'after'", param="after")
        query = query.where(File.seq < cursor if order == "desc" else File.seq > cursor)
    query = query.order_by(File.seq.desc() if order == "desc" else File.seq.asc())
    rows = list(session.scalars(query.limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def delete_file(session: Session, store: Store, *, tenant_id: str, file_id: str) -> None:
    """Delete the row, then the bytes. A file an unfinished job still reads is kept (409)."""
    row = get_file(session, tenant_id=tenant_id, file_id=file_id)
    user = session.scalar(
        select(Job.id).where(
            Job.tenant_id == tenant_id,
            Job.status.in_(UNFINISHED),
            (Job.training_file == file_id) | (Job.validation_file == file_id),
        )
    )
    if user is not None:
        raise ConflictError(
            f"file {file_id} is used by fine-tuning job {user}, which has not finished", param="file_id"
        )
    key = row.storage_key
    session.delete(row)
    session.flush()
    # The row goes first: a crash between the two leaves an orphan object, never a dangling row.
    session.commit()
    store.delete(key)
    store.delete_tree(derived_key(key))


def file_content(store: Store, row: File) -> Iterator[bytes]:
    return store.iter_verified(row.storage_key, row.sha256)
