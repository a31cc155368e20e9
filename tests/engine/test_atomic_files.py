"""Files replaced whole or not at all (worker/engine/atomic_files.py): the one writer behind the
stores' objects, a pulled GGUF, the model registry and a Hub model's marker."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from worker.engine.atomic_files import AtomicFile, file_sha256, write_atomic


def test_commit_replaces_the_file_with_what_was_written(tmp_path: Path) -> None:
    target = tmp_path / "model.gguf"
    target.write_bytes(b"old")
    with AtomicFile(target, mode=0o644) as f:
        f.write(b"new ")
        f.write(b"bytes")
        assert target.read_bytes() == b"old"  # nothing shows before the commit
        assert f.tmp.parent == tmp_path and f.tmp.name.startswith(".model.gguf.") and f.tmp.suffix == ".part"
        f.commit()
    assert target.read_bytes() == b"new bytes"
    assert f.size == 9 and f.sha256() == hashlib.sha256(b"new bytes").hexdigest() == file_sha256(target)
    assert target.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_leaving_without_commit_keeps_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "registry.json"
    write_atomic(target, "{}\n")
    assert target.stat().st_mode & 0o777 == 0o600  # mkstemp's: private unless asked otherwise
    with pytest.raises(ValueError, match="sha256 mismatch"), AtomicFile(target) as f:
        f.write(b"half")
        raise ValueError("sha256 mismatch")
    assert target.read_text() == "{}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["registry.json"]
