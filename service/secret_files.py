"""Secrets generated once under the data dir when not configured: the HMAC key of stored API-key
hashes (service/auth.py) and the `/metrics` bearer token (service/api/metrics.py).

The file is written whole to a temporary name, owner-only, then hard-linked to its own name,
which never replaces an existing file: processes starting at once (API workers, `loraq up` and a
CLI command) all read the first one's value, and none can read a half-written file.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path


def read_or_create(path: Path, make: Callable[[], str]) -> str:
    """The secret in `path`; first `make()` it there (mode 0600) if the file does not exist."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(make())
                fh.flush()
                os.fsync(fh.fileno())
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: its value is the one
        finally:
            tmp.unlink()
    return path.read_text().strip()
