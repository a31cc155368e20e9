"""/v1/files through the real app: upload (streamed, size-limited), list with pagination,
retrieve, content (sha256 re-checked), delete, and the error bodies."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, LoraqEnv


def stored_files(env: LoraqEnv) -> list[Path]:
    root = env.store_root / "files"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def assert_error(resp: object, status: int, param: str | None = None) -> dict[str, object]:
    r = resp
    assert r.status_code == status, r.text  # type: ignore[attr-defined]
    err: dict[str, object] = r.json()["error"]  # type: ignore[attr-defined]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_upload_retrieve_content_delete(api: ApiClient, loraq_env: LoraqEnv) -> None:
    r = api.post(
        "/v1/files", data={"purpose": "fine-tune"}, files={"file": ("../../etc/train.jsonl", DATASET)}
    )
    assert r.status_code == 200, r.text
    f = r.json()
    assert f["id"].startswith("file-") and f["object"] == "file"
    assert (f["bytes"], f["filename"], f["purpose"], f["status"]) == (
        len(DATASET),
        "train.jsonl",
        "fine-tune",
        "processed",
    )

    assert api.get(f"/v1/files/{f['id']}").json() == f
    content = api.get(f"/v1/files/{f['id']}/content")
    assert content.status_code == 200 and content.content == DATASET
    (path,) = stored_files(loraq_env)
    assert path.read_bytes() == DATASET and loraq_env.store_root in path.parents

    d = api.delete(f"/v1/files/{f['id']}")
    assert d.json() == {"id": f["id"], "object": "file", "deleted": True}
    assert stored_files(loraq_env) == []
    assert_error(api.get(f"/v1/files/{f['id']}"), 404)
    assert_error(api.delete(f"/v1/files/{f['id']}"), 404)


def test_content_download_rechecks_sha256(api: ApiClient, loraq_env: LoraqEnv) -> None:
    file_id = api.upload(DATASET)
    (path,) = stored_files(loraq_env)
    path.write_bytes(DATASET.replace(b"arr", b"ARR"))  # bit rot / tampering in the store
    err = assert_error(api.get(f"/v1/files/{file_id}/content"), 500)
    assert err["code"] == "storage_error"


def test_list_files_paginates(api: ApiClient) -> None:
    ids = [api.upload(DATASET, filename=f"f{i}.jsonl") for i in range(5)]
    page = api.get("/v1/files", params={"limit": 2}).json()
    assert page["object"] == "list" and page["has_more"] is True
    assert [f["id"] for f in page["data"]] == ids[::-1][:2]
    assert (page["first_id"], page["last_id"]) == (ids[4], ids[3])
    seen = [f["id"] for f in page["data"]]
    while page["has_more"]:
        page = api.get("/v1/files", params={"limit": 2, "after": page["last_id"]}).json()
        seen += [f["id"] for f in page["data"]]
    assert seen == ids[::-1]
    asc = api.get("/v1/files", params={"order": "asc", "limit": 3}).json()
    assert [f["id"] for f in asc["data"]] == ids[:3]
    assert api.get("/v1/files", params={"purpose": "fine-tune-results"}).json()["data"] == []
    assert_error(api.get("/v1/files", params={"after": "file-nope"}), 404, "after")
    assert_error(api.get("/v1/files", params={"limit": 0}), 400, "limit")


@pytest.mark.parametrize(
    ("data", "files", "param"),
    [
        ({"purpose": "assistants"}, {"file": ("a.jsonl", DATASET)}, "purpose"),
        ({}, {"file": ("a.jsonl", DATASET)}, "purpose"),
        ({"purpose": "fine-tune"}, None, "file"),
        ({"purpose": "fine-tune", "owner": "someone"}, {"file": ("a.jsonl", DATASET)}, "owner"),
        ({"purpose": "fine-tune"}, {"other": ("a.jsonl", DATASET)}, "other"),
    ],
)
def test_upload_errors_name_the_field_and_leave_nothing(
    api: ApiClient, loraq_env: LoraqEnv, data: dict[str, str], files: dict[str, object] | None, param: str
) -> None:
    r = api.post("/v1/files", data=data, files=files) if files else api.post("/v1/files", data=data)
    assert_error(r, 400, param)
    assert stored_files(loraq_env) == []
    assert api.get("/v1/files").json()["data"] == []


def test_upload_one_byte_over_the_limit_is_413_with_no_partial_file(
    api: ApiClient, loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 256 * 1024
    monkeypatch.setenv("LORAQ_MAX_UPLOAD_BYTES", str(limit))
    get_settings.cache_clear()
    exact = b"x" * limit
    ok = api.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("ok.jsonl", exact)})
    assert ok.status_code == 200 and ok.json()["bytes"] == limit
    over = api.post("/v1/files", data={"purpose": "fine-tune"}, files={"file": ("big.jsonl", exact + b"y")})
    err = assert_error(over, 413, "file")
    assert err["code"] == "file_too_large"
    (only,) = stored_files(loraq_env)  # the accepted upload; no temp file of the rejected one
    assert hashlib.sha256(only.read_bytes()).hexdigest() == hashlib.sha256(exact).hexdigest()
    assert [f["id"] for f in api.get("/v1/files").json()["data"]] == [ok.json()["id"]]


def test_upload_declared_far_over_the_limit_is_refused_before_reading(
    api: ApiClient, loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAQ_MAX_UPLOAD_BYTES", "1000")
    get_settings.cache_clear()
    body = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n' + b"x" * 200_000
    r = api.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert_error(r, 413, "file")
    assert stored_files(loraq_env) == []


def test_truncated_multipart_body_leaves_nothing(api: ApiClient, loraq_env: LoraqEnv) -> None:
    body = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n' + b"x" * 5000
    r = api.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert_error(r, 400, "file")
    assert stored_files(loraq_env) == []
    assert not any(p.name.endswith(".part") for p in loraq_env.store_root.rglob("*"))


def test_upload_requires_multipart(api: ApiClient) -> None:
    assert_error(api.post("/v1/files", json={"purpose": "fine-tune"}), 400, "file")


def test_chunked_upload_without_content_length_is_limited_while_streaming(
    api: ApiClient, loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORAQ_MAX_UPLOAD_BYTES", "100000")
    get_settings.cache_clear()
    head = b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
    head += b'--b\r\nContent-Disposition: form-data; name="file"; filename="c.jsonl"\r\n\r\n'

    def body(size: int) -> Iterator[bytes]:
        yield head
        for _ in range(size // 1000):
            yield b"y" * 1000
        yield b"\r\n--b--\r\n"

    headers = {"Content-Type": "multipart/form-data; boundary=b"}
    ok = api.post("/v1/files", content=body(100_000), headers=headers)
    assert ok.status_code == 200 and ok.json()["bytes"] == 100_000
    assert_error(api.post("/v1/files", content=body(101_000), headers=headers), 413, "file")
    assert len(stored_files(loraq_env)) == 1


@pytest.mark.parametrize(
    "body",
    [
        b"garbage without any boundary",
        b'--x\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nv\r\n--x--\r\n',
        b"--b\r\n" + b"X-Header: " + b"h" * 10_000 + b"\r\n\r\nv\r\n--b--\r\n",
        b"--b\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(50)) + b"\r\nv\r\n--b--\r\n",
    ],
)
def test_malformed_multipart_is_400_not_500(api: ApiClient, loraq_env: LoraqEnv, body: bytes) -> None:
    r = api.post("/v1/files", content=body, headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert_error(r, 400, "file")
    assert stored_files(loraq_env) == []
