"""The file store: atomic writes with sha256, the size limit while streaming, verification on
read, zip round trips, and keys that cannot leave the root."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from service.errors import PayloadTooLargeError, StorageError
from service.storage import FileStore


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_streamed_write_is_atomic_and_hashed(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    with store.writer("files/t/a", max_bytes=10) as w:
        w.write(b"hello ")
        assert not store.exists("files/t/a")  # nothing visible before commit
        assert [p.name.endswith(".part") for p in files_under(store.root)] == [True]
        w.write(b"test")
        obj = w.commit()
    assert (obj.key, obj.size, obj.sha256) == ("files/t/a", 10, hashlib.sha256(b"hello test").hexdigest())
    assert files_under(store.root) == [store.path("files/t/a")]
    assert b"".join(store.iter_verified(obj.key, obj.sha256)) == b"hello test"


def test_size_limit_while_streaming_leaves_no_file(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    with pytest.raises(PayloadTooLargeError), store.writer("files/t/big", max_bytes=10) as w:
        w.write(b"12345")
        w.write(b"678901")  # 11 bytes: one over
    assert files_under(store.root) == []


def test_error_inside_the_block_removes_the_temp_file(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    with pytest.raises(RuntimeError), store.writer("x/y") as w:
        w.write(b"partial")
        raise RuntimeError("client went away")
    assert files_under(store.root) == []


def test_overwrite_replaces_whole_object(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    store.put_bytes("k", b"old contents")
    obj = store.put_bytes("k", b"new")
    assert store.path("k").read_bytes() == b"new" and obj.size == 3


def test_verify_detects_corruption_and_missing_objects(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    obj = store.put_bytes("a/b.bin", b"payload")
    store.path("a/b.bin").write_bytes(b"pAyload")
    with pytest.raises(StorageError, match="sha256"):
        store.verify(obj.key, obj.sha256)
    with pytest.raises(StorageError, match="sha256"):
        next(store.iter_verified(obj.key, obj.sha256))
    store.delete("a/b.bin")
    with pytest.raises(StorageError, match="missing"):
        store.verify(obj.key, obj.sha256)


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../x", "a/../../x", "a//b", "a/./../b"])
def test_keys_cannot_escape_the_root(tmp_path: Path, key: str) -> None:
    with pytest.raises(StorageError, match="invalid storage key"):
        FileStore(tmp_path / "store").path(key)


def test_directory_zip_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "adapter"
    (src / "sub").mkdir(parents=True)
    (src / "adapter_config.json").write_text('{"r": 4}')
    (src / "sub" / "w.safetensors").write_bytes(b"\x00" * 100)
    store = FileStore(tmp_path / "store")
    obj = store.put_dir_zip(src, "jobs/j/adapter.zip")
    with zipfile.ZipFile(store.path(obj.key)) as zf:
        assert sorted(zf.namelist()) == ["adapter_config.json", "sub/w.safetensors"]
    out = store.extract_zip(obj.key, tmp_path / "out")
    assert (out / "sub" / "w.safetensors").read_bytes() == b"\x00" * 100
    assert files_under(store.root) == [store.path(obj.key)]  # no temp archive left behind


def test_extract_refuses_zip_slip(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "store")
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as zf:
        zf.writestr("../../outside.txt", "gotcha")
    store.put_file(evil, "jobs/j/ckpt.zip")
    with pytest.raises(StorageError, match="unsafe member"):
        store.extract_zip("jobs/j/ckpt.zip", tmp_path / "dest")
    assert not (tmp_path / "outside.txt").exists()


def test_sweep_removes_only_old_partials(tmp_path: Path) -> None:
    import os
    import time

    store = FileStore(tmp_path / "store")
    kept = store.put_bytes("files/t/done", b"complete")
    w = store.writer("files/t/live")
    w.write(b"in flight")
    old = store.path("files/t") / ".crashed.abc.part"
    old.write_bytes(b"left by a killed process")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert store.sweep_partials(older_than_s=3600) == 1
    assert not old.exists() and store.exists(kept.key)
    assert w.commit().size == len(b"in flight")  # the live writer was not touched
