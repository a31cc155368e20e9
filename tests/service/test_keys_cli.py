"""`loraq keys create|list|revoke` (real subprocesses) against a database the API reads: list
shows prefixes only, and a key revoked from the CLI is refused by the API at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ApiClient, LoraqEnv

ROOT = Path(__file__).resolve().parents[2]


def loraq(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return out.stdout


def test_keys_cli_create_list_revoke(api: ApiClient, loraq_env: LoraqEnv) -> None:
    key = loraq("keys", "create", "--tenant", "cli-tenant").strip().splitlines()[-1]
    assert key.startswith("sk-lq-")
    headers = {"Authorization": f"Bearer {key}"}
    assert api.client.get("/v1/files", headers=headers).status_code == 200

    listing = loraq("keys", "list")
    assert key[:14] in listing and "cli-tenant" in listing
    assert key not in listing and key[14:] not in listing  # prefixes only

    loraq("keys", "revoke", key[:14])
    r = api.client.get("/v1/files", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "revoked_api_key"
    assert api.get("/v1/files").status_code == 200  # other keys unaffected
