"""The API on an S3 bucket (a real S3-compatible server process, moto's): uploads land in the
bucket under the configured prefix and nothing in the local store; downloads stream from the
bucket (hashed on the way: a corrupt object's download ends short) or redirect to a presigned URL;
a 96 MiB upload streams through a real API process with bounded memory."""

from __future__ import annotations

import hashlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.storage import default_store
from service.storage_s3 import S3Store
from tests.conftest import DATASET, ApiClient, LoraqEnv
from tests.live_server import serve
from tests.servers import S3Server, shared_s3
from tests.service.test_upload_memory import LIMIT, MAX_GROWTH, peak_rss, post, start_api


@pytest.fixture
def db_url(_sqlite_db: str) -> str:
    """These tests are about the store: one database (SQLite) is enough."""
    return _sqlite_db


@pytest.fixture
def s3(loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Store]:
    """The test's settings point at a new bucket (prefix `tenant-data`) on the suite's S3 server."""
    from service.settings import get_settings

    server = shared_s3()
    for name, value in server.env(server.new_bucket(), prefix="tenant-data").items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    store = default_store()
    assert isinstance(store, S3Store)
    yield store
    get_settings.cache_clear()


def test_uploads_land_in_the_bucket_and_downloads_stream_from_it(
    s3: S3Store, api: ApiClient, loraq_env: LoraqEnv
) -> None:
    file_id = api.upload(DATASET)
    key = f"tenant-data/files/{api.tenant_id}/{file_id}"
    got = s3.client.get_object(Bucket=s3.config.bucket, Key=key)["Body"].read()
    assert got == DATASET
    assert not loraq_env.store_root.exists()  # nothing in the local store directory
    r = api.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200 and r.content == DATASET
    assert r.headers["content-length"] == str(len(DATASET))
    assert r.headers["content-disposition"] == 'attachment; filename="train.jsonl"'
    # deleted from the bucket with the file
    assert api.delete(f"/v1/files/{file_id}").status_code == 200
    assert "Contents" not in s3.client.list_objects_v2(Bucket=s3.config.bucket, Prefix=key)


def test_a_corrupt_object_never_downloads_whole(s3: S3Store, api: ApiClient) -> None:
    from service.app import create_app

    data = DATASET * 4000  # 400 KB: several chunks of the stream
    file_id = api.upload(data)
    s3.put_bytes(f"files/{api.tenant_id}/{file_id}", data[:-2] + b"X\n")  # same size, one byte off
    received = bytearray()
    with (
        serve(create_app()) as url,
        httpx.Client(base_url=url, headers=api.headers) as c,
        pytest.raises(httpx.RemoteProtocolError),
        c.stream("GET", f"/v1/files/{file_id}/content") as r,
    ):
        assert r.status_code == 200  # the status went out before the bytes were read
        for chunk in r.iter_bytes():
            received += chunk
    assert 0 < len(received) < len(data)  # streamed, then cut short of its Content-Length


def test_downloads_redirect_to_a_presigned_url(
    s3: S3Store, api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.settings import get_settings

    file_id = api.upload(DATASET, filename="my data.jsonl")
    monkeypatch.setenv("LORAQ_STORAGE_PRESIGN_DOWNLOADS", "1")
    monkeypatch.setenv("LORAQ_STORAGE_PRESIGN_SECONDS", "60")
    get_settings.cache_clear()
    r = api.get(f"/v1/files/{file_id}/content", follow_redirects=False)
    assert r.status_code == 307, r.text
    location = r.headers["location"]
    assert location.startswith(s3.config.endpoint_url or "") and "Expires=" in location
    direct = httpx.get(location)  # no API key: the URL's signature is the permission
    assert direct.status_code == 200 and direct.content == DATASET
    assert direct.headers["content-disposition"] == "attachment; filename*=utf-8''my%20data.jsonl"
    tampered = location.replace(f"files/{api.tenant_id}/{file_id}", f"files/{api.tenant_id}/other")
    assert httpx.get(tampered).status_code == 403  # the signature covers the key


def test_presigned_urls_are_signed_for_the_public_endpoint(
    s3: S3Store, api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API reaches the bucket at one address, its clients at another (docker/two-hosts:
    http://minio:9000 inside, which no client resolves, the host's address outside): the
    redirect names the public one, and the object downloads from there."""
    from service.settings import get_settings

    file_id = api.upload(DATASET)
    internal = s3.config.endpoint_url
    assert internal is not None and "127.0.0.1" in internal
    public = internal.replace("127.0.0.1", "localhost")  # the same server under another host name
    monkeypatch.setenv("LORAQ_STORAGE_PRESIGN_DOWNLOADS", "1")
    monkeypatch.setenv("LORAQ_S3_PUBLIC_ENDPOINT_URL", public)
    get_settings.cache_clear()
    r = api.get(f"/v1/files/{file_id}/content", follow_redirects=False)
    assert r.status_code == 307, r.text
    location = r.headers["location"]
    assert location.startswith(f"{public}/"), location
    direct = httpx.get(location)
    assert direct.status_code == 200 and direct.content == DATASET


@pytest.mark.slow
def test_a_large_upload_streams_to_s3_with_bounded_memory(tmp_path: Path) -> None:
    server: S3Server = shared_s3()
    env = server.env(server.new_bucket())
    env["LORAQ_STORAGE_PART_BYTES"] = str(8 << 20)  # the default part size: 12 parts
    base, key, proc = start_api(tmp_path / "var", LORAQ_MAX_UPLOAD_BYTES=str(LIMIT), **env)
    try:
        assert post(base, key, 1024).status_code == 200  # warm up: imports, DB pool, first request
        before = peak_rss(proc.pid)
        t0 = time.perf_counter()
        ok = post(base, key, LIMIT)
        seconds = time.perf_counter() - t0
        assert ok.status_code == 200, ok.text
        growth = peak_rss(proc.pid) - before
        print(f"uploaded {LIMIT >> 20} MiB to S3 in {seconds:.2f}s; peak RSS growth {growth / 2**20:.1f} MiB")
        assert growth < MAX_GROWTH
        listed = server.client().list_objects_v2(Bucket=env["LORAQ_STORAGE_URL"].split("/")[2])
        sizes = sorted(o["Size"] for o in listed["Contents"])
        assert sizes == [1024, LIMIT]
        assert not (tmp_path / "var" / "store").exists()
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=120) as c:
            digest, n = hashlib.sha256(), 0
            with c.stream("GET", f"/v1/files/{ok.json()['id']}/content") as r:
                for chunk in r.iter_bytes():
                    digest.update(chunk)
                    n += len(chunk)
        assert n == LIMIT and peak_rss(proc.pid) - before < MAX_GROWTH  # the download streamed too
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert isinstance(proc, subprocess.Popen)
