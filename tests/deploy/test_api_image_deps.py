"""The API image installs no worker-only dependencies (docker/api.Dockerfile, WORKER_ONLY_DEPS):
the API app must import, start and answer without them. Checked in a subprocess whose import
system refuses those modules, so an accidental `import torch` on the API path fails here."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.deploy.test_dockerfiles import api_excluded_deps

ROOT = Path(__file__).resolve().parents[2]


def test_api_app_runs_without_worker_only_dependencies(tmp_path: Path) -> None:
    blocked = api_excluded_deps()
    assert "torch" in blocked and "transformers" in blocked
    script = textwrap.dedent(
        f"""
        import importlib.abc, json, sys

        BLOCKED = {blocked!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"{{name}} is not installed in the API image")
                return None

        sys.meta_path.insert(0, Block())
        from fastapi.testclient import TestClient
        from service.app import create_app
        from service.db.migrate import upgrade_head
        from service.settings import get_settings

        from service.auth import create_key
        from service.db.session import session_scope

        upgrade_head(get_settings().resolved_database_url)
        with session_scope() as session:
            key = create_key(session, "deploy")
        auth = {{"Authorization": f"Bearer {{key}}"}}
        turns = [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "yo"}}]
        row = json.dumps({{"messages": turns}})
        with TestClient(create_app()) as client:
            assert client.get("/healthz").status_code == 200, client.get("/healthz").text
            r = client.get("/v1/models", headers=auth)
            assert r.status_code == 200 and r.json()["data"], r.text
            r = client.post("/v1/files", headers=auth, data={{"purpose": "fine-tune"}},
                            files={{"file": ("t.jsonl", (row + "\\n") * 4)}})
            assert r.status_code == 200, r.text
            body = {{"model": "tiny-llama", "training_file": r.json()["id"], "queue": "h100"}}
            r = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
            # Redis is unreachable here: the job stays queued for the reconciler, the request succeeds.
            assert r.status_code == 200 and r.json()["status"] == "queued", r.text
            assert r.json()["queue"] == "h100"
            # The API image counts tokens (tokenizers, no torch): a max_seq_len shorter than the
            # data is refused at submit, not by a worker minutes later.
            story = [{{"role": "user", "content": "tell"}},
                     {{"role": "assistant", "content": "a long story " * 20}}]
            r = client.post("/v1/files", headers=auth, data={{"purpose": "fine-tune"}},
                            files={{"file": ("s.jsonl", (json.dumps({{"messages": story}}) + "\\n") * 4)}})
            body = {{"model": "tiny-llama", "training_file": r.json()["id"], "max_seq_len": 32}}
            r = client.post("/v1/fine_tuning/jobs", headers=auth, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "max_seq_len_too_short", r.text
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
        print("ok")
        """
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "LORAQ_DATA_DIR": str(tmp_path),
        "LORAQ_REDIS_URL": "redis://127.0.0.1:1/0",  # never reached by these requests
    }
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]
