"""The CLI explains itself: one-line errors naming the field, exit 2 and a hint when the server is
unreachable, tracebacks only with --debug, human times, tables that fit 80 columns with ids cut to
a unique prefix that every `jobs` command accepts, and `jobs cancel` saying what the server did.

The CLI runs as a subprocess (`python -m service.cli`, as the installed `loraq` does) against a real
uvicorn API in a thread of this process, on SQLite; jobs stay queued (no worker)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service import cli_format as fmt
from tests.conftest import DATASET, make_tenant_key
from tests.live_server import free_port, serve


def loraq(*args: str, env: dict[str, str], columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = {**env, "COLUMNS": str(columns), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env=env,
        cwd="/",  # paths come from settings, never from the current directory
        capture_output=True,
        text=True,
        timeout=120,
    )


@dataclass
class LiveApi:
    url: str
    key: str
    tenant_id: str
    env: dict[str, str]


@pytest.fixture
def live_api(_sqlite_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LiveApi]:
    import redis

    from service.app import create_app
    from service.settings import get_settings
    from tests.servers import shared_redis_url

    queue = f"test-cli-{os.getpid()}-{time.monotonic_ns()}"
    settings_env = {
        "LORAQ_DATA_DIR": str(tmp_path / "var"),
        "LORAQ_DATABASE_URL": _sqlite_db,
        "LORAQ_REDIS_URL": shared_redis_url(),
        "LORAQ_WORKER_QUEUE": queue,
        "LORAQ_REAPER_INTERVAL_SECONDS": "0",
    }
    for k, v in settings_env.items():
        monkeypatch.setenv(k, v)
    get_settings.cache_clear()
    tenant_id, key = make_tenant_key()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
    try:
        with serve(create_app()) as url:
            env.update(LORAQ_URL=url, LORAQ_API_KEY=key)
            yield LiveApi(url=url, key=key, tenant_id=tenant_id, env=env)
    finally:
        get_settings.cache_clear()
        r = redis.Redis.from_url(shared_redis_url())
        r.delete(queue)
        r.close()


def http(api: LiveApi, method: str, path: str, **kw: object) -> dict[str, object]:
    import httpx

    r = httpx.request(method, api.url + path, headers={"Authorization": f"Bearer {api.key}"}, **kw)  # type: ignore[arg-type]
    assert r.is_success, r.text
    body: dict[str, object] = r.json()
    return body


def one_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    return lines[0]


# --------------------------------------------------------------------------- pure formatting


def test_durations_and_times_read_as_words() -> None:
    assert fmt.duration(202) == "3m 22s"
    assert fmt.duration(9) == "9s"
    assert fmt.duration(3600 + 5 * 60 + 1) == "1h 05m"
    assert fmt.duration(None) == "-"
    now = 1_000_000.0
    assert fmt.ago(now - 125, now) == "2 min ago"
    assert fmt.ago(now - 3, now) == "just now"
    assert fmt.ago(now - 2 * 86400, now) == "2 days ago"
    assert fmt.job_duration({"started_at": 100, "finished_at": 302}) == "3m 22s"
    assert fmt.job_duration({"started_at": None}) == "-"
    assert fmt.size(1536) == "1.5 KiB"


def test_unique_prefixes_are_unique_and_short() -> None:
    ids = ["ftjob-abcdefgh1111", "ftjob-abcdefgh2222", "ftjob-zzzzzzzz0000"]
    short = fmt.unique_prefixes(ids)
    assert short["ftjob-zzzzzzzz0000"] == "ftjob-zzzzzz"
    assert short["ftjob-abcdefgh1111"] == "ftjob-abcdefgh1"
    for i, p in short.items():
        assert i.startswith(p) and [o for o in ids if o.startswith(p)] == [i]


# --------------------------------------------------------------------------- errors


def test_unreachable_server_is_one_line_with_url_cause_and_hint() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
    out = loraq("jobs", "list", env={**env, "LORAQ_URL": url, "LORAQ_API_KEY": "sk-x"})
    assert out.returncode == 2
    line = one_line(out.stderr)
    assert url in line and "connection refused" in line.lower()
    assert "is `loraq up` running? set LORAQ_URL" in line
    assert "Traceback" not in out.stderr + out.stdout

    debug = loraq("--debug", "jobs", "list", env={**env, "LORAQ_URL": url, "LORAQ_API_KEY": "sk-x"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr + debug.stdout


def test_expected_errors_are_one_line_naming_the_field(live_api: LiveApi) -> None:
    bad = loraq("jobs", "create", "--model", "tiny-llama", "--training-file", "file-nope", env=live_api.env)
    assert bad.returncode == 1
    line = one_line(bad.stderr)
    assert line.startswith("error: training_file:") and "file-nope" in line and "HTTP 404" in line

    missing = loraq("jobs", "get", "ftjob-nosuchjob", env=live_api.env)
    assert missing.returncode == 1 and "no fine-tuning job id starts with" in one_line(missing.stderr)

    wrong_key = loraq("jobs", "list", env={**live_api.env, "LORAQ_API_KEY": "sk-wrong"})
    assert wrong_key.returncode == 1 and "HTTP 401" in one_line(wrong_key.stderr)
    assert "Traceback" not in bad.stderr + missing.stderr + wrong_key.stderr


def test_upload_of_a_file_that_fails_validation_exits_1_naming_the_line(
    live_api: LiveApi, tmp_path: Path
) -> None:
    good = tmp_path / "good.jsonl"
    good.write_bytes(DATASET)
    ok = loraq("files", "upload", str(good), env=live_api.env)
    assert ok.returncode == 0 and '"status": "processed"' in ok.stdout, ok.stderr

    # the last line's closing brace is missing: the column is that line's end, not "column 1"
    line = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "arr"}]'
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(DATASET + line + b"\n")
    out = loraq("files", "upload", str(bad), env=live_api.env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert '"status": "error"' in out.stdout  # the file object still prints: its id is stored
    error = one_line(out.stderr)
    assert error.startswith("error: ") and str(bad) in error and "failed validation" in error
    column = f"column {len(line) + 1} (the end of the line)"
    assert f"line 5: not valid JSON: Expecting ',' delimiter at {column}" in error


# --------------------------------------------------------------------------- tables and cancel


def test_jobs_table_fits_80_columns_and_its_short_ids_work(live_api: LiveApi) -> None:
    file_id = http(live_api, "POST", "/v1/files", data={"purpose": "fine-tune"},
                   files={"file": ("t.jsonl", DATASET)})["id"]  # fmt: skip
    body = {"model": "tiny-llama", "training_file": file_id, "max_seq_len": 64}
    created = [
        http(live_api, "POST", "/v1/fine_tuning/jobs", json={**body, "suffix": f"a-long-suffix-{i}"})
        for i in range(3)
    ]
    listing = loraq("jobs", "list", env=live_api.env)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert all(len(x) <= 80 for x in lines), "\n".join(lines)
    assert "duration" in lines[0] and "suffix" in lines[0] and "model" in lines[0]
    assert "just now" in listing.stdout or "s ago" in listing.stdout
    for job in created:
        assert str(job["id"]) not in listing.stdout  # shortened...
    short = [x.split()[0] for x in lines[2:] if x.strip()]
    assert len(short) == 3 and len(set(short)) == 3
    full = {str(j["id"]) for j in created}
    assert {next(f for f in full if f.startswith(s)) for s in short} == full  # ...to unique prefixes

    # --wide shows every id in full.
    wide = loraq("jobs", "list", "--wide", env=live_api.env)
    assert all(str(j["id"]) in wide.stdout for j in created)

    # A prefix works wherever an id does; a queued job is cancelled at once, and the CLI says so.
    target = next(s for s in short if str(created[0]["id"]).startswith(s))
    cancel = loraq("jobs", "cancel", target, env=live_api.env)
    assert cancel.returncode == 0, cancel.stderr
    assert one_line(cancel.stdout) == f"{created[0]['id']}: cancelled"


def test_cancel_of_a_running_job_says_the_server_status(live_api: LiveApi) -> None:
    from service import jobs
    from service.db.session import session_scope

    file_id = http(live_api, "POST", "/v1/files", data={"purpose": "fine-tune"},
                   files={"file": ("t.jsonl", DATASET)})["id"]  # fmt: skip
    job = http(live_api, "POST", "/v1/fine_tuning/jobs",
               json={"model": "tiny-llama", "training_file": file_id, "max_seq_len": 64})  # fmt: skip
    with session_scope() as s:  # a worker claims it: running
        assert jobs.claim(s, job_id=str(job["id"]), worker_id="test:cpu") is not None
    out = loraq("jobs", "cancel", str(job["id"]), env=live_api.env)
    assert out.returncode == 0, out.stderr
    line = one_line(out.stdout)
    assert line.startswith(f"{job['id']}: running, cancel requested")
    listing = loraq("jobs", "list", env=live_api.env).stdout
    assert "running (cancelling)" in listing or "running (canc" in listing


def test_pause_and_resume_say_the_server_status(live_api: LiveApi) -> None:
    from service import jobs
    from service.db.session import session_scope

    file_id = http(live_api, "POST", "/v1/files", data={"purpose": "fine-tune"},
                   files={"file": ("t.jsonl", DATASET)})["id"]  # fmt: skip
    job = http(live_api, "POST", "/v1/fine_tuning/jobs",
               json={"model": "tiny-llama", "training_file": file_id, "max_seq_len": 64})  # fmt: skip
    job_id = str(job["id"])
    assert one_line(loraq("jobs", "pause", job_id, env=live_api.env).stdout) == f"{job_id}: paused"
    assert one_line(loraq("jobs", "resume", job_id, env=live_api.env).stdout) == f"{job_id}: queued"
    with session_scope() as s:  # a worker claims it: running
        assert jobs.claim(s, job_id=job_id, worker_id="test:cpu") is not None
    line = one_line(loraq("jobs", "pause", job_id, env=live_api.env).stdout)
    assert line.startswith(f"{job_id}: running, pause requested (a checkpoint is kept)"), line
    assert "running (pausing)" in loraq("jobs", "list", env=live_api.env).stdout
    again = loraq("jobs", "resume", job_id, env=live_api.env)  # withdrawn before the worker got there
    assert one_line(again.stdout) == f"{job_id}: running"
    refused = loraq("jobs", "resume", job_id, env=live_api.env)
    assert refused.returncode == 1 and "cannot be resumed" in refused.stderr, refused


def test_events_print_health_warnings_and_fold_step_lines(live_api: LiveApi) -> None:
    from service import jobs
    from service.db.session import session_scope

    file_id = http(live_api, "POST", "/v1/files", data={"purpose": "fine-tune"},
                   files={"file": ("t.jsonl", DATASET)})["id"]  # fmt: skip
    job = http(live_api, "POST", "/v1/fine_tuning/jobs",
               json={"model": "tiny-llama", "training_file": file_id, "max_seq_len": 64})  # fmt: skip
    warning = "Overfitting: validation loss rose 1.0 -> 1.2 over the last 2 evaluations"
    with session_scope() as s:
        for step in (1, 2, 3):
            jobs.add_event(s, job_id=str(job["id"]), level="info", message=f"Step {step}", type="metrics",
                           data={"step": step, "train_loss": 1.0})  # fmt: skip
        jobs.add_event(s, job_id=str(job["id"]), level="warn", message=warning,
                       data={"health": "overfitting", "step": 3})  # fmt: skip
    out = loraq("jobs", "events", str(job["id"]), env=live_api.env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(" warn " in x and warning in x for x in lines)
    assert not any("Step 2" in x for x in lines) and "(3 per-step lines folded; --steps shows them)" in lines
    assert lines.index(next(x for x in lines if "queued" in x)) < lines.index(
        next(x for x in lines if warning in x)
    )
    steps = loraq("jobs", "events", str(job["id"]), "--steps", env=live_api.env).stdout
    assert "Step 2" in steps

    # `jobs watch` prints the warnings as they come, then the end (cancelled: exit code 1). Not on
    # a terminal it prints a line for every step, in order with the messages, even steps that
    # arrived between two of its polls (here all three were there before the first)
    http(live_api, "POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel")
    watch = loraq("jobs", "watch", str(job["id"]), env=live_api.env)
    assert watch.returncode == 1 and warning in watch.stdout and "cancelled" in watch.stdout
    lines = watch.stdout.splitlines()
    at = [next(i for i, x in enumerate(lines) if x.startswith(f"step {n}/")) for n in (1, 2, 3)]
    assert at == sorted(at) and at[-1] < next(i for i, x in enumerate(lines) if warning in x), lines


def test_paths_come_from_settings_not_the_current_directory(tmp_path: Path) -> None:
    from service.settings import PROJECT_ROOT, default_data_dir

    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAQ_")}
    titles = []
    for cwd in ("/", str(tmp_path)):
        out = subprocess.run(
            [sys.executable, "-m", "service.cli", "models", "list"],
            env={**env, "COLUMNS": "1000"}, cwd=cwd, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        titles.append(out.stdout.splitlines()[0].strip())
    assert titles[0] == titles[1] == f"Base models ({PROJECT_ROOT / 'var' / 'models'})"
    assert default_data_dir() == PROJECT_ROOT / "var"  # a checkout: its own var/
