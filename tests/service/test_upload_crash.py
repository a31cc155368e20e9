"""An API process killed (SIGKILL) in the middle of an upload: nothing half-written becomes
visible. After a restart the file is not listed, no object exists under its key, and the temp
file the killed process left is invisible to readers (and swept once it is old)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx

from service.storage import FileStore
from tests.service.test_upload_memory import start_api


def test_killed_api_mid_upload_leaves_nothing_visible(tmp_path: Path) -> None:
    data_dir = tmp_path / "var"
    base, key, proc = start_api(data_dir)
    port = int(base.rsplit(":", 1)[1])
    boundary = "crashboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    ).encode()
    total = len(head) + 8 * 2**20 + 64
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(
            f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {total}\r\n\r\n".encode()
            + head
            + b"x" * (2 * 2**20)  # a quarter of the file, then the server dies
        )
        store = data_dir / "store"
        for _ in range(100):  # wait until the server is writing the temp file
            if any(store.rglob("*.part")):
                break
            time.sleep(0.05)
        assert any(store.rglob("*.part"))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        sock.close()

    # Only an invisible temp file remains: no object, no row.
    objects = [p for p in (data_dir / "store").rglob("*") if p.is_file() and not p.name.endswith(".part")]
    assert objects == []
    base, key, proc = start_api(data_dir)
    try:
        listed = httpx.get(base + "/v1/files", headers={"Authorization": f"Bearer {key}"}).json()
        assert listed["data"] == []
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert FileStore(data_dir / "store").sweep_partials(older_than_s=0) == 1
