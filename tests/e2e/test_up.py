"""`loraq up`: everything starts, answers, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import redis

from service.up import Supervisor
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import ROOT, clean_env, free_port, wait_for
from tests.servers import api_ready, create_pg_database, drop_pg_database


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def group_members(pgids: set[int]) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) in pgids and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def test_supervisor_stop_kills_whole_process_groups(tmp_path: Path) -> None:
    sup = Supervisor(pid_file=tmp_path / "pids.json", grace=0.5)
    # A shell whose background child stays in its group; the shell ignores SIGTERM, so only the
    # SIGKILL after the grace period can end it.
    script = "trap '' TERM; sleep 300 & sleep 300; wait"
    child = sup.spawn("stubborn", ["sh", "-c", script], env=dict(os.environ), log_path=None)
    wait_for(lambda: len(psutil.Process(child.pid).children()) >= 2, "shell children", 5)
    grandchildren = [p.pid for p in psutil.Process(child.pid).children()]
    assert json.loads((tmp_path / "pids.json").read_text())["stubborn"] == child.pid

    t0 = time.monotonic()
    sup.stop()
    assert time.monotonic() - t0 < 5
    assert not alive(child.pid)
    # SIGKILL is delivered asynchronously; the orphans are gone a moment later.
    wait_for(lambda: not any(alive(pid) for pid in grandchildren), "grandchildren killed", 5)
    assert not (tmp_path / "pids.json").exists()


@contextlib.contextmanager
def running_up(tmp_path: Path, **env_vars: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`loraq up` in its own session (as a terminal would run it) until its API is ready."""
    data_dir = tmp_path / "var"
    port = free_port()
    env = clean_env(LORAQ_DATA_DIR=str(data_dir), LORAQ_PORT=str(port), **env_vars)
    out = (tmp_path / "up.out").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "up"],
        env=env,
        cwd=ROOT,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    try:
        wait_for(lambda: api_ready(url), "loraq up", 120, proc)
        # Printed, with the URL and the key, once the API answers and both workers have registered
        # (they import torch: tens of seconds after the API on a busy machine).
        wait_for(lambda: "Press Ctrl-C" in (tmp_path / "up.out").read_text(), "banner", 120, proc)
        assert_workers_registered((tmp_path / "up.out").read_text(), data_dir, env)
        wait_for(
            lambda: " ready." in (data_dir / "logs" / "worker.log").read_text(errors="replace"),
            "worker ready",
            120,
            proc,
        )
        yield proc, url, data_dir
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pid_file = data_dir / "up.pids.json"
        for pid in json.loads(pid_file.read_text()).values() if pid_file.exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        out.close()


def assert_workers_registered(banner: str, data_dir: Path, env: dict[str, str]) -> None:
    """What "Loraq is up" promises: the worker and the inference worker it started (these pids)
    have registered already."""
    from service.inference import inference_worker_id, workers_key
    from service.worker_registry import list_workers

    pids = json.loads((data_dir / "up.pids.json").read_text())
    client = redis.Redis.from_url(next(w for w in banner.split() if w.startswith("redis://")))
    assert pids["worker"] in [w["pid"] for w in list_workers(client)], banner
    inference = workers_key(env.get("LORAQ_INFERENCE_QUEUE", "inference"))
    assert client.zscore(inference, inference_worker_id(pids["inference"])) is not None, banner
    assert banner.index("The API answers on") < banner.index("Loraq is up"), banner


def stop_and_check_nothing_left(proc: subprocess.Popen[bytes], data_dir: Path, sig: int) -> None:
    pids = json.loads((data_dir / "up.pids.json").read_text())
    assert pids.pop("supervisor") == proc.pid
    children = set(pids.values())
    assert all(alive(pid) for pid in children)
    pgids = {os.getpgid(pid) for pid in children}
    assert len(group_members(pgids)) >= len(children)

    t0 = time.monotonic()
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 0
    assert time.monotonic() - t0 < 30
    assert not [pid for pid in children if alive(pid)]
    # Anything else in the children's groups got SIGKILL, which lands asynchronously.
    wait_for(lambda: group_members(pgids) == [], "process groups empty", 5)
    assert not (data_dir / "up.pids.json").exists()


def test_loraq_up_serves_and_sigint_stops_every_child(tmp_path: Path) -> None:
    key = "sk-up-" + secrets.token_hex(16)
    with running_up(tmp_path, LORAQ_API_KEY=key) as (proc, url, data_dir):
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(url + "/v1/fine_tuning/jobs", headers=auth).status_code == 200
        bad = httpx.get(url + "/v1/fine_tuning/jobs", headers={"Authorization": "Bearer sk-nope"})
        assert bad.status_code == 401
        assert set(json.loads((data_dir / "up.pids.json").read_text())) == {
            "supervisor",
            "redis",
            "api",
            "worker",
            "inference",
        }
        # `loraq up` serves chat completions and dry runs (on its inference worker) from its banner on
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        file_id = httpx.post(
            url + "/v1/files", data={"purpose": "fine-tune"}, headers=auth,
            files={"file": ("t.jsonl", chat_lines(8))},
        ).json()["id"]  # fmt: skip
        dry = {"model": "tiny-llama", "training_file": file_id, "dry_run": True}
        plan = httpx.post(url + "/v1/fine_tuning/jobs", json=dry, headers=auth, timeout=60)
        assert plan.status_code == 200 and plan.json()["valid"], plan.text
        answer = httpx.post(url + "/v1/chat/completions", json=chat, headers=auth, timeout=60).json()
        assert (
            answer["usage"]["completion_tokens"] <= 3
            and answer["choices"][0]["message"]["role"] == "assistant"
        )
        # The Redis it started is a real server, and SQLite lives under the data dir.
        banner = (tmp_path / "up.out").read_text()
        assert url in banner and key in banner
        redis_url = next(w for w in banner.split() if w.startswith("redis://"))
        assert redis.Redis.from_url(redis_url).ping()
        assert (data_dir / "loraq.db").exists()

        stop_and_check_nothing_left(proc, data_dir, signal.SIGINT)
    assert "Stopped." in (tmp_path / "up.out").read_text()


def test_loraq_up_uses_given_redis_and_postgresql_and_generates_a_key(tmp_path: Path, redis_url: str) -> None:
    import psycopg

    name, db_url = create_pg_database("loraq_up")
    try:
        with running_up(tmp_path, LORAQ_REDIS_URL=redis_url, LORAQ_DATABASE_URL=db_url) as (
            proc,
            url,
            data_dir,
        ):
            assert set(json.loads((data_dir / "up.pids.json").read_text())) == {
                "supervisor",
                "api",
                "worker",
                "inference",
            }
            banner = (tmp_path / "up.out").read_text()
            key = banner.split("API key (generated for tenant default): ", 1)[1].split()[0]
            auth = {"Authorization": f"Bearer {key}"}
            assert httpx.get(url + "/v1/fine_tuning/jobs", headers=auth).status_code == 200
            assert not (data_dir / "loraq.db").exists()
            with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
                assert conn.execute("SELECT count(*) FROM api_keys").fetchone() == (1,)

            stop_and_check_nothing_left(proc, data_dir, signal.SIGTERM)
        assert redis.Redis.from_url(redis_url).ping()  # not ours to stop
    finally:
        drop_pg_database(name)


def test_ctrl_c_requeues_a_running_job_and_the_next_up_finishes_it(tmp_path: Path) -> None:
    key = "sk-up-" + secrets.token_hex(16)
    env = {"LORAQ_API_KEY": key, "LORAQ_CHECKPOINT_EVERY": "20"}
    auth = {"Authorization": f"Bearer {key}"}
    # 16 examples, batch 4, 100 epochs: 400 steps, about 10 s on an idle 2-core CPU. Long enough
    # that Ctrl-C lands mid-run even on a fast machine (24 steps once finished before it did).
    total = 400
    with running_up(tmp_path, **env) as (proc, url, data_dir):
        api = httpx.Client(base_url=url + "/v1", headers=auth, timeout=30)
        file_id = api.post(
            "/files", data={"purpose": "fine-tune"}, files={"file": ("t.jsonl", chat_lines(16))}
        ).json()["id"]
        body = {
            "model": "tiny-llama",
            "training_file": file_id,
            "hyperparameters": {"n_epochs": 100, "batch_size": 4},
            "lora": {"r": 4},
            "max_seq_len": 128,
            "packing": False,  # one example per row: the test counts steps
        }
        job_id = api.post("/fine_tuning/jobs", json=body).json()["id"]

        def steps_done() -> int:
            events = api.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 10_000}).json()["data"]
            return sum(e["type"] == "metrics" for e in events)

        wait_for(lambda: steps_done() >= 25, "first checkpoint", 120, proc)
        stop_and_check_nothing_left(proc, data_dir, signal.SIGINT)

    with sqlite3.connect(data_dir / "loraq.db") as db:
        assert db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone() == ("queued",)
        assert db.execute("SELECT count(*) FROM checkpoints WHERE job_id = ?", (job_id,)).fetchone()[0] >= 1

    with running_up(tmp_path, **env) as (proc, url, data_dir):
        api = httpx.Client(base_url=url + "/v1", headers=auth, timeout=30)

        def status() -> str:
            return str(api.get(f"/fine_tuning/jobs/{job_id}").json()["status"])

        wait_for(lambda: status() in {"succeeded", "failed", "cancelled"}, "job finished", 180, proc)
        job = api.get(f"/fine_tuning/jobs/{job_id}").json()
        assert job["status"] == "succeeded", job["error"]
        events = api.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 10_000}).json()["data"]
        steps = sorted(e["data"]["step"] for e in events if e["type"] == "metrics")
        assert steps == list(range(1, total + 1))
        assert any("re-queued" in e["message"] for e in events)
        stop_and_check_nothing_left(proc, data_dir, signal.SIGINT)
