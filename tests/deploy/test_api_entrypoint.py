"""docker/api-entrypoint.sh, run as the API container runs it (outside Docker): against a fresh
PostgreSQL database it migrates, registers LORAQ_API_KEY, serves, and stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.e2e.procs import ROOT, clean_env, free_port, stop_process, wait_for
from tests.servers import api_ready


def test_entrypoint_migrates_registers_key_and_serves(tmp_path: Path, pg_db_url: str, redis_url: str) -> None:
    port = free_port()
    venv_bin = str(Path(sys.executable).parent)  # `python` and `uvicorn`, as on the image's PATH
    env = clean_env(
        PATH=f"{venv_bin}:/usr/bin:/bin",
        LORAQ_DATA_DIR=str(tmp_path),
        LORAQ_DATABASE_URL=pg_db_url,
        LORAQ_REDIS_URL=redis_url,
        LORAQ_API_KEY="sk-deploy-test-key",
        LORAQ_HOST="127.0.0.1",
        LORAQ_PORT=str(port),
    )
    log = tmp_path / "api.log"
    proc = subprocess.Popen(
        [str(ROOT / "docker" / "api-entrypoint.sh")], env=env, cwd=ROOT,
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    try:
        wait_for(lambda: api_ready(base), "API from the entrypoint", 90, proc)
        assert "database migrated" in log.read_text()
        ok = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sk-deploy-test-key"})
        assert ok.status_code == 200, ok.text
        bad = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        assert bad.status_code == 401
        # `exec uvicorn`: the server is the process the container runtime signals; it shuts down
        # gracefully, then re-raises SIGTERM (uvicorn's exit status for a signalled stop)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
        assert "Finished server process" in log.read_text()
    except BaseException:
        print(log.read_text(errors="replace")[-4000:])
        raise
    finally:
        stop_process(proc)
