"""Uploads stream: a real API process (uvicorn) receives a 96 MiB upload and a (limit + 1)-byte
upload while its peak RSS (VmHWM) is watched. The body is never held in memory: the peak grows
by far less than the upload, and the rejected upload leaves nothing in the store."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.db.migrate import upgrade_head
from service.up import free_port

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 96 * 1024 * 1024
CHUNK = b"0123456789abcdef" * 4096  # 64 KiB
MAX_GROWTH = 32 * 1024 * 1024  # a third of the upload: buffering it would blow through this


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def multipart_body(size: int, boundary: str) -> tuple[Iterator[bytes], int]:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def gen() -> Iterator[bytes]:
        yield head
        left = size
        while left > 0:
            piece = CHUNK[: min(len(CHUNK), left)]
            left -= len(piece)
            yield piece
        yield tail

    return gen(), len(head) + size + len(tail)


def start_api(data_dir: Path, **extra_env: str) -> tuple[str, str, subprocess.Popen[bytes]]:
    """A migrated SQLite database under `data_dir`, a key, and a uvicorn API process on a free port."""
    url = f"sqlite:///{data_dir / 'loraq.db'}"
    env = {
        **os.environ,
        "LORAQ_DATA_DIR": str(data_dir),
        "LORAQ_DATABASE_URL": url,
        "LORAQ_SECRET_KEY": "s" * 64,
        **extra_env,
    }
    upgrade_head(url)
    key = subprocess.run(
        [sys.executable, "-m", "service.cli", "keys", "create", "--tenant", "mem"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip().splitlines()[-1]  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory", "--port", str(port),
         "--no-access-log", "--log-level", "warning"],
        env=env, cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                return base, key, proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the API did not start")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, str, subprocess.Popen[bytes], Path]]:
    data_dir = tmp_path / "var"
    base, key, proc = start_api(data_dir, LORAQ_MAX_UPLOAD_BYTES=str(LIMIT))
    try:
        yield base, key, proc, data_dir / "store"
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def post(base: str, key: str, size: int) -> httpx.Response:
    boundary = "loraqboundary"
    body, length = multipart_body(size, boundary)
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
        "Content-Length": str(length),
    }
    with httpx.Client(timeout=120) as c:
        return c.post(base + "/v1/files", content=body, headers=headers)


def test_upload_streams_with_flat_memory_and_limit_plus_one_is_413(
    server: tuple[str, str, subprocess.Popen[bytes], Path],
) -> None:
    base, key, proc, store = server
    assert post(base, key, 1024).status_code == 200  # warm up: imports, DB pool, first request
    before = peak_rss(proc.pid)

    t0 = time.perf_counter()
    ok = post(base, key, LIMIT)
    seconds = time.perf_counter() - t0
    assert ok.status_code == 200, ok.text
    assert ok.json()["bytes"] == LIMIT
    growth = peak_rss(proc.pid) - before
    print(f"uploaded {LIMIT >> 20} MiB in {seconds:.2f}s ({LIMIT / seconds / 2**20:.0f} MiB/s); "
          f"peak RSS growth {growth / 2**20:.1f} MiB")  # fmt: skip
    assert growth < MAX_GROWTH

    over = post(base, key, LIMIT + 1)
    assert over.status_code == 413, over.text
    assert over.json()["error"]["param"] == "file"
    assert peak_rss(proc.pid) - before < MAX_GROWTH
    files = sorted(p for p in store.rglob("*") if p.is_file())
    assert len(files) == 2 and not any(p.name.endswith(".part") for p in files)
    assert sorted(p.stat().st_size for p in files) == [1024, LIMIT]
