"""Build Loraq's CUDA kernels (gpu_kernels/csrc/*.cu) into one shared library with nvcc.

The library has a C ABI (raw pointers, sizes, a cudaStream_t) and is loaded with ctypes, so it
needs nvcc and the CUDA runtime only, not a CUDA build of torch's headers. Builds are cached on
disk under `cache_dir()` (default `~/.cache/loraq/kernels`; `set_cache_dir`, which a worker calls
with LORAQ_KERNEL_CACHE, or `--cache-dir` picks another), keyed by a hash of the sources, the
flags and the target architectures: a worker pays the build once, and a new source version never
loads a stale library.

    python -m gpu_kernels.build              # for the GPU present (else the fallback arch list)
    python -m gpu_kernels.build --arch 90 --cache-dir /opt/loraq/kernels   # ahead of time (worker image)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
# Ampere, Ada, Hopper: the archs built when no GPU is visible to pick one.
FALLBACK_ARCHS: tuple[str, ...] = ("80", "86", "89", "90")
NVCC_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")


class BuildError(RuntimeError):
    """nvcc is missing or failed; the message carries the compiler's output."""


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cu"))


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.cuh"))


_cache_dir: Path | None = None  # None: the default below


def set_cache_dir(path: Path | None) -> None:
    """Where builds are cached from now on (None: `~/.cache/loraq/kernels`)."""
    global _cache_dir
    _cache_dir = path


def cache_dir() -> Path:
    return _cache_dir if _cache_dir is not None else Path.home() / ".cache" / "loraq" / "kernels"


def find_nvcc() -> str | None:
    # CUDA_HOME/CUDA_PATH: the CUDA toolkit's own convention (torch's cpp_extension reads them too),
    # not a Loraq setting
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def detect_archs() -> tuple[str, ...]:
    """The compute capability of every visible GPU ("90" on Hopper), else the fallback list."""
    if torch.cuda.is_available():
        caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        return tuple(sorted(f"{major}{minor}" for major, minor in caps))
    return FALLBACK_ARCHS


def gencode_flags(archs: tuple[str, ...]) -> list[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # PTX of the newest arch too, so a newer GPU can still JIT the library at load time
    flags.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    return flags


def build_key(archs: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for path in [*sources(), *headers()]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(NVCC_FLAGS).encode())
    h.update(",".join(archs).encode())
    return h.hexdigest()[:16]


def library_path(archs: tuple[str, ...]) -> Path:
    return cache_dir() / f"libloraq_kernels-{build_key(archs)}-sm{'_'.join(archs)}.so"


def compile_library(srcs: list[Path], out: Path, archs: tuple[str, ...]) -> None:
    """nvcc srcs -> out (a shared library). Raises BuildError with nvcc's output on failure."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    cmd = [nvcc, *NVCC_FLAGS, *gencode_flags(archs), "-I", str(CSRC), "-o", str(out), *map(str, srcs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BuildError(f"nvcc failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def build(archs: tuple[str, ...] | None = None, *, force: bool = False) -> Path:
    """Return the cached library for these archs, compiling it first if needed."""
    archs = archs or detect_archs()
    target = library_path(archs)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build next to the target and rename: concurrent workers never load a half-written file
    fd, tmp_name = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        compile_library(sources(), tmp, archs)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", action="append", help="compute capability like 90 (repeatable)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--cache-dir", type=Path, help="cache directory (default ~/.cache/loraq/kernels)")
    args = parser.parse_args(argv)
    if args.cache_dir is not None:
        set_cache_dir(args.cache_dir)
    archs = tuple(sorted(args.arch)) if args.arch else None
    try:
        path = build(archs, force=args.force)
    except BuildError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
