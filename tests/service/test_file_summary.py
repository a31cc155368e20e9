"""The dataset summary (`GET /dashboard/api/files/{id}/summary`) is computed once per file, by its
upload, and served from the file's row: the file is never parsed again for it."""

from __future__ import annotations

from sqlalchemy import select, update

from service import storage
from service.db.models import File
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient, store_file

BAD = DATASET + b"{not json\n"


def summary_column(file_id: str) -> object:
    with session_scope() as s:
        return s.scalar(select(File.summary).where(File.id == file_id))


def test_the_upload_stores_the_summary_that_the_dashboard_serves(api: ApiClient) -> None:
    file_id = api.upload(BAD)
    stored = summary_column(file_id)
    assert isinstance(stored, dict) and stored["examples"] == 4 and stored["bad_line_count"] == 1
    with session_scope() as s:  # the bytes are gone: only the stored summary can answer now
        key = s.scalars(select(File.storage_key).where(File.id == file_id)).one()
    storage.default_store().delete(key)
    body = api.get(f"/dashboard/api/files/{file_id}/summary").json()
    assert body["examples"] == 4 and body["valid"] is False
    assert body["bad_lines"] == [{"line": 5, "reason": stored["bad_lines"][0]["reason"]}]
    assert body["bad_lines"][0]["reason"].startswith("not valid JSON")


def test_a_file_stored_without_a_summary_is_checked_once(api: ApiClient) -> None:
    file_id = store_file(api.tenant_id, DATASET)  # as files uploaded before summaries were stored
    assert summary_column(file_id) is None
    first = api.get(f"/dashboard/api/files/{file_id}/summary").json()
    assert first["examples"] == 4 and first["valid"] is True
    stored = summary_column(file_id)
    assert stored == {k: v for k, v in first.items() if k not in ("file_id", "filename")}
    assert isinstance(stored, dict)
    with session_scope() as s:  # marked, so a second parse would show: it must not happen
        s.execute(update(File).where(File.id == file_id).values(summary={**stored, "examples": 99}))
    assert api.get(f"/dashboard/api/files/{file_id}/summary").json()["examples"] == 99
