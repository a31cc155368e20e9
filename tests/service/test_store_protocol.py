"""The store's interface (service/storage.py) against both stores: the directory tree and an
S3 bucket on a real S3-compatible server process (moto's, tests/servers.py). Each test runs on
both: streamed writes publish whole or not at all, the size limit holds while streaming, reads
re-check the sha256, `materialize` gives a local file (S3: a bounded cache), checkpoints are
trusted only with their manifest, and what a killed writer left behind is swept."""

from __future__ import annotations

import hashlib
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.errors import PayloadTooLargeError, StorageError
from service.storage import FileStore, Store, checkpoint_sha256, default_store, manifest_key, put_checkpoint
from service.storage_s3 import S3Store, S3Writer
from tests.servers import S3_MIN_PART_BYTES, shared_s3

PART = S3_MIN_PART_BYTES


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    """`default_store()` as a process configured for each store sees it."""
    from service.settings import get_settings

    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path / "var"))
    if request.param == "s3":
        server = shared_s3()
        for name, value in server.env(server.new_bucket(), prefix="pre/fix").items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("LORAQ_STORAGE_CACHE_BYTES", str(3 * PART))
    get_settings.cache_clear()
    yield default_store()
    get_settings.cache_clear()


def is_s3(store: Store) -> bool:
    return isinstance(store, S3Store)


def bucket_keys(store: S3Store) -> list[str]:
    """Every object in the bucket (whatever the prefix)."""
    listed = store.client.list_objects_v2(Bucket=store.config.bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def unfinished_uploads(store: S3Store) -> list[str]:
    listed = store.client.list_multipart_uploads(Bucket=store.config.bucket)
    return [u["Key"] for u in listed.get("Uploads", [])]


def visible(store: Store) -> list[str]:
    """What a reader can see: the bucket's objects, or the directory's files (temp files too)."""
    if isinstance(store, S3Store):
        return bucket_keys(store)
    assert isinstance(store, FileStore)
    return sorted(p.relative_to(store.root).as_posix() for p in store.root.rglob("*") if p.is_file())


def test_a_streamed_write_is_published_whole_at_commit(store: Store) -> None:
    data = os.urandom(3 * PART + 123)  # S3: three full parts and a short last one
    with store.writer("files/t/a", max_bytes=len(data)) as w:
        for i in range(0, len(data), 8192):  # (a part is full at exactly PART bytes)
            w.write(data[i : i + 8192])
        assert not store.exists("files/t/a")  # nothing visible before commit
        if isinstance(w, S3Writer):
            assert w.buffered < PART  # less than one part held: the rest went up already
            assert unfinished_uploads(w.store) == ["pre/fix/files/t/a"]
        obj = w.commit()
    assert (obj.key, obj.size, obj.sha256) == ("files/t/a", len(data), hashlib.sha256(data).hexdigest())
    assert store.size("files/t/a") == len(data) and store.exists("files/t/a")
    assert b"".join(store.iter_verified(obj.key, obj.sha256)) == data
    if isinstance(store, S3Store):
        assert bucket_keys(store) == ["pre/fix/files/t/a"]  # under the prefix
        etag = store.client.head_object(Bucket=store.config.bucket, Key="pre/fix/files/t/a")["ETag"]
        assert etag.strip('"').endswith("-4")  # a multipart upload of 4 parts
        assert unfinished_uploads(store) == []
    else:
        assert visible(store) == ["files/t/a"]


def test_a_small_object_is_one_put(store: Store) -> None:
    obj = store.put_bytes("a/b.bin", b"payload")
    assert store.get_bytes("a/b.bin") == b"payload" and obj.size == 7
    assert store.put_bytes("a/b.bin", b"new").size == 3  # overwritten whole
    assert store.get_bytes("a/b.bin") == b"new"


def test_the_size_limit_while_streaming_leaves_nothing(store: Store) -> None:
    with pytest.raises(PayloadTooLargeError), store.writer("files/t/big", max_bytes=2 * PART) as w:
        w.write(os.urandom(PART + 1))  # S3: one part sent already
        w.write(os.urandom(PART))
    assert visible(store) == []
    if isinstance(store, S3Store):
        assert unfinished_uploads(store) == []  # its upload aborted


def test_an_error_inside_the_block_leaves_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError), store.writer("x/y") as w:
        w.write(os.urandom(2 * PART))
        raise RuntimeError("client went away")
    assert visible(store) == []
    if isinstance(store, S3Store):
        assert unfinished_uploads(store) == []


def corrupt(store: Store, key: str, data: bytes) -> None:
    """Change the object's bytes behind the store's back."""
    if isinstance(store, S3Store):
        store.client.put_object(Bucket=store.config.bucket, Key=store.name(key), Body=data)
    else:
        assert isinstance(store, FileStore)
        store.path(key).write_bytes(data)


def test_reads_recheck_the_sha256(store: Store) -> None:
    obj = store.put_bytes("a/b.bin", b"payload")
    corrupt(store, "a/b.bin", b"pAyload")
    with pytest.raises(StorageError, match="sha256"):
        b"".join(store.iter_verified(obj.key, obj.sha256))
    with pytest.raises(StorageError, match="sha256"):
        store.materialize(obj.key, obj.sha256)
    with pytest.raises(FileNotFoundError):
        store.get_bytes("a/missing")
    with pytest.raises(StorageError, match="missing"):
        store.materialize("a/missing")
    with pytest.raises(StorageError, match="invalid storage key"):
        store.put_bytes("../escape", b"x")


def test_materialize_gives_a_local_file(store: Store) -> None:
    data = os.urandom(PART)
    obj = store.put_bytes("files/t/data", data)
    path = store.materialize(obj.key, obj.sha256)
    assert path.read_bytes() == data
    if isinstance(store, S3Store):  # a copy in this host's cache; a corrupt copy is fetched again
        assert path.is_relative_to(store.config.cache_dir)
        path.write_bytes(b"rot")
        assert store.materialize(obj.key, obj.sha256).read_bytes() == data


@pytest.mark.parametrize("store", ["s3"], indirect=True)  # a directory store has no cache
def test_the_cache_is_bounded_least_recently_used_first(store: Store) -> None:
    assert isinstance(store, S3Store)
    objs = [store.put_bytes(f"files/t/{i}", os.urandom(PART)) for i in range(4)]  # cache: 3 parts
    paths = [store.materialize(o.key, o.sha256) for o in objs[:3]]
    store.materialize(objs[0].key, objs[0].sha256)  # 0 used again: 1 is now the oldest
    os.utime(paths[1], (1, 1))  # (mtime resolution: make the order explicit)
    store.materialize(objs[3].key, objs[3].sha256)
    cached = sorted(p.name for p in store.config.cache_dir.rglob("*") if p.is_file())
    assert cached == ["0", "2", "3"]


def test_zips_round_trip_and_trees_delete(store: Store, tmp_path: Path) -> None:
    src = tmp_path / "adapter"
    (src / "sub").mkdir(parents=True)
    (src / "adapter_config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(PART + 5))
    obj = store.put_dir_zip(src, "jobs/j/adapter.zip")
    out = store.extract_zip(obj.key, tmp_path / "out", obj.sha256)
    assert (out / "sub" / "w.bin").read_bytes() == (src / "sub" / "w.bin").read_bytes()
    store.put_bytes("jobs/j2/keep", b"k")
    store.delete_tree("jobs/j")
    assert not store.exists("jobs/j/adapter.zip") and store.get_bytes("jobs/j2/keep") == b"k"
    store.delete("jobs/j2/keep")
    store.delete("jobs/j2/keep")  # a missing object is no error
    assert not store.exists("jobs/j2/keep")


def test_a_checkpoint_is_trusted_only_with_its_manifest(store: Store, tmp_path: Path) -> None:
    ckpt = tmp_path / "step-3"
    ckpt.mkdir()
    (ckpt / "adapter_model.safetensors").write_bytes(os.urandom(1000))
    key = "jobs/j/attempt-1/checkpoints/step-000003.zip"
    stored = put_checkpoint(store, ckpt, key, step=3)
    assert checkpoint_sha256(store, key) == stored.sha256
    # a writer stopped between the zip and the manifest: the zip is there, nobody trusts it
    half = "jobs/j/attempt-1/checkpoints/step-000006.zip"
    store.put_dir_zip(ckpt, half)
    assert checkpoint_sha256(store, half) is None
    store.put_bytes(manifest_key(half), b'{"object": "jobs/j/other.zip", "sha256": "00"}')
    assert checkpoint_sha256(store, half) is None  # a manifest for another object
    with zipfile.ZipFile(store.materialize(key, stored.sha256)) as zf:
        assert zf.namelist() == ["adapter_model.safetensors"]


def test_sweep_removes_what_a_killed_writer_left(store: Store) -> None:
    w = store.writer("files/t/killed")
    w.write(os.urandom(PART + 1))  # never committed nor aborted: the process died here
    if isinstance(store, FileStore):  # (moto dates every upload 2010-11-10: its age is not testable)
        assert store.sweep_partials(older_than_s=3600) == 0  # a young one may be a live writer's
    assert store.sweep_partials(older_than_s=0) == 1
    assert visible(store) == []
    if isinstance(store, S3Store):
        assert unfinished_uploads(store) == []
