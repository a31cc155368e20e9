"""The `loraq` CLI against the running service: keys, files, jobs (create, list, get, events,
cancel), and clear errors instead of tracebacks."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import httpx

from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service


def test_keys_create_list_revoke(e2e: Service) -> None:
    tenant = f"cli-{secrets.token_hex(4)}"
    key = e2e.new_key(tenant)
    url = e2e.url + "/v1/fine_tuning/jobs"
    assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200

    listing = e2e.cli("keys", "list").stdout
    prefix = next(p for p in re.findall(r"sk-\S+", listing) if key.startswith(p))
    assert key not in listing  # prefixes only, never the key
    assert tenant in listing

    e2e.cli("keys", "revoke", prefix)
    unknown = e2e.cli("keys", "revoke", "sk-lq-nosuchkey", check=False)
    assert (
        unknown.returncode == 1 and "sk-lq-nosuchkey" in unknown.stderr and "Traceback" not in unknown.stderr
    )
    revoked = httpx.get(url, headers={"Authorization": f"Bearer {key}"})
    assert revoked.status_code == 401
    assert revoked.json()["error"]["code"] == "revoked_api_key"


def test_files_and_jobs_commands(e2e: Service, tmp_path: Path) -> None:
    key = e2e.new_key(f"cli-{secrets.token_hex(4)}")  # a tenant of its own: `jobs list` shows only ours
    env_key = ("--api-key", key)
    data = tmp_path / "train.jsonl"
    data.write_bytes(chat_lines(8))

    uploaded = json.loads(e2e.cli("files", "upload", str(data), *env_key).stdout)
    assert uploaded["id"].startswith("file-") and uploaded["bytes"] == data.stat().st_size
    assert uploaded["id"] in e2e.cli("files", "list", "--wide", *env_key).stdout  # full ids with --wide

    created = json.loads(
        e2e.cli(
            "jobs", "create", "--model", "tiny-llama", "--training-file", uploaded["id"],
            "--n-epochs", "400", "--suffix", "cli", "--lora-r", "4", "--max-seq-len", "128", "--no-packing",
            *env_key,
        ).stdout
    )  # fmt: skip
    job_id = created["id"]
    assert created["hyperparameters"]["n_epochs"] == 400 and created["packing"] is False
    assert created["model"] == "tiny-llama" and created["training_file"] == uploaded["id"]

    assert job_id in e2e.cli("jobs", "list", "--wide", *env_key).stdout
    assert json.loads(e2e.cli("jobs", "get", job_id, *env_key).stdout)["id"] == job_id
    assert job_id in e2e.cli("jobs", "cancel", job_id, *env_key).stdout
    e2e.wait_job(job_id, {"cancelled"}, key=key)
    events = e2e.cli("jobs", "events", job_id, *env_key).stdout
    assert "cancel" in events.lower()

    # `jobs watch` on a cancelled job ends with exit code 1 and says so.
    watch = e2e.cli("jobs", "watch", job_id, *env_key, check=False)
    assert watch.returncode == 1 and "cancelled" in watch.stdout


def test_cli_errors_are_messages_not_tracebacks(e2e: Service) -> None:
    missing = e2e.cli("jobs", "get", "ftjob-nope", check=False)
    assert missing.returncode == 1
    assert "ftjob-nope" in missing.stderr and "Traceback" not in missing.stderr

    bad_key = e2e.cli("jobs", "list", "--api-key", "sk-wrong", check=False)
    assert bad_key.returncode == 1 and "HTTP 401" in bad_key.stderr

    bad_model = e2e.cli(
        "jobs", "create", "--model", "no-such-model", "--training-file", "file-x", check=False
    )
    assert bad_model.returncode == 1
    assert "no-such-model" in bad_model.stderr or "file-x" in bad_model.stderr
