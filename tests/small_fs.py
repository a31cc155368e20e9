"""A small real filesystem to fill up: a tmpfs of a few MiB mounted on a temp dir.

Writes to it fail as on a full disk (ENOSPC), and a write through a shared mapping of an
unallocated page gets SIGBUS, as on ext4. Mounting needs root, which CI has (it runs the suite
as root); elsewhere the test fails saying so, never skips.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BALLAST = ".ballast"
PAGE = 4096


@dataclass
class SmallFs:
    root: Path

    def free(self) -> int:
        return shutil.disk_usage(self.root).free

    def fill(self) -> None:
        """Take every free byte with a ballast file (posix_fallocate, then page by page for what a
        rounding left), so the next write that needs a new block fails with ENOSPC."""
        with (self.root / BALLAST).open("ab") as f:
            with contextlib.suppress(OSError):
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, self.free())
            with contextlib.suppress(OSError):
                while True:
                    os.write(f.fileno(), b"\0" * PAGE)
        assert self.free() < PAGE, self.free()

    def unfill(self) -> None:
        (self.root / BALLAST).unlink(missing_ok=True)

    def files(self) -> set[str]:
        """Every file on it but the ballast, relative to its root."""
        return {
            p.relative_to(self.root).as_posix()
            for p in self.root.rglob("*")
            if p.is_file() and p.name != BALLAST
        }


@contextlib.contextmanager
def small_fs(size_mib: int) -> Iterator[SmallFs]:
    root = Path(tempfile.mkdtemp(prefix="loraq-small-fs-"))
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0777", "tmpfs", str(root)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        root.rmdir()
        pytest.fail(
            f"cannot mount a {size_mib} MiB tmpfs to fill up ({done.stderr.strip()}): "
            "the disk-full tests need root, as CI runs them",
            pytrace=False,
        )
    try:
        yield SmallFs(root)
    finally:
        subprocess.run(["umount", "--lazy", str(root)], check=True)
        root.rmdir()
