"""The nvcc build: every csrc/*.cu must compile and link (CI has nvcc but no GPU), the library
must export the C ABI the ctypes loader declares, and the cache must be keyed by the sources."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from gpu_kernels import _lib, build

needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not installed")


@needs_nvcc
def test_every_cu_compiles_links_and_exports_the_c_abi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "_cache_dir", tmp_path)
    assert len(build.sources()) >= 4
    path = build.build(("90",))  # one arch keeps CI fast; every source goes through nvcc and the linker
    assert path.parent == tmp_path and path.is_file()
    lib = ctypes.CDLL(str(path))
    for name in _lib.SIGNATURES:
        assert hasattr(lib, name), f"{name} missing from the library"
    # host-side parts of the ABI run without a GPU
    _lib._declare(lib)
    numels = (ctypes.c_int64 * 3)(16384, 16385, 5)
    assert lib.loraq_clip_partials(numels, 3) == 1 + 2 + 1
    assert lib.loraq_error_string(1) == b"invalid argument"
    # cached: a second build returns the same file without compiling again
    mtime = path.stat().st_mtime_ns
    assert build.build(("90",)) == path and path.stat().st_mtime_ns == mtime


@needs_nvcc
def test_a_compile_error_reaches_the_caller_with_nvcc_output(tmp_path: Path) -> None:
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" int f() { return undefined_name; }\n')
    with pytest.raises(build.BuildError, match="undefined_name"):
        build.compile_library([bad], tmp_path / "libbad.so", ("90",))


def test_missing_nvcc_is_a_build_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.BuildError, match="nvcc not found"):
        build.compile_library(build.sources(), tmp_path / "x.so", ("90",))


def test_cache_key_follows_sources_and_archs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    key = build.build_key(("90",))
    assert build.build_key(("80", "90")) != key
    (csrc / "lora.cu").write_text((csrc / "lora.cu").read_text() + "\n// changed\n")
    assert build.build_key(("90",)) != key
    monkeypatch.setattr(build, "_cache_dir", None)
    assert build.library_path(("90",)).parent == Path.home() / ".cache" / "loraq" / "kernels"
    build.set_cache_dir(tmp_path / "cache")
    assert build.library_path(("90",)).parent == tmp_path / "cache"


def test_fallback_archs_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.torch.cuda, "is_available", lambda: False)
    assert build.detect_archs() == ("80", "86", "89", "90")
    flags = build.gencode_flags(("80", "90"))
    assert "-gencode=arch=compute_90,code=sm_90" in flags
    assert flags[-1] == "-gencode=arch=compute_90,code=compute_90"  # PTX for newer GPUs
