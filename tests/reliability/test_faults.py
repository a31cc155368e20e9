"""Fault injection against real processes (PostgreSQL, a private redis-server, uvicorn, Celery
workers training tiny-llama): SIGKILL, SIGTERM and SIGSTOP/SIGCONT of a worker mid-training, and a
Redis restart with jobs queued. Each ends by checking the database: every job succeeded exactly
once, no metric step stored twice, one adapter whose bytes match its sha256."""

from __future__ import annotations

import io
import json
import os
import signal
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.procs import stop_process
from tests.reliability.conftest import HEARTBEAT_TIMEOUT_S, TERMINAL, Stack

EPOCHS = 25  # 16 examples, batch 4: 100 steps (about 2.5 s on a 2-core CPU)


def adapter_tensors(data: bytes) -> dict[str, object]:
    from safetensors.torch import load

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        name = next(n for n in zf.namelist() if n.endswith("adapter_model.safetensors"))
        return dict(load(zf.read(name)))


def test_sigkill_mid_training_resumes_from_the_last_checkpoint(stack: Stack) -> None:
    import torch

    stack.ensure_workers(1)
    job_id = stack.submit(EPOCHS)
    stack.wait(job_id, {"running"})
    ckpt_step = stack.wait_checkpoint(job_id)
    victim = stack.worker_running(job_id)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    killed_at = max(stack.metric_steps(job_id), default=0)
    assert stack.job(job_id)["status"] == "running"  # nobody told the database
    assert killed_at < EPOCHS * 4, "the job finished before the kill; make it longer"
    with stack.client() as c:
        before = c.get(f"/fine_tuning/jobs/{job_id}/checkpoints", params={"limit": 100}).json()["data"]
    last_saved = before[0]["step_number"]
    assert last_saved >= ckpt_step

    stack.start_worker()  # the restarted worker
    stack.assert_succeeded_once(job_id, attempts=2)
    events = stack.events(job_id)
    assert any(f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g}s (attempt 1 of 3)" in e for e in events), events
    # It resumes from the last checkpoint saved before the kill, and says which step
    assert f"Resuming from the checkpoint at step {last_saved}" in events, events
    resumed = [e for e in events if e.startswith("Resumed from checkpoint at step")]
    assert resumed == [f"Resumed from checkpoint at step {last_saved}"], events
    with stack.client() as c:  # the ids of checkpoints saved before the resume still answer
        for ckpt in before:
            r = c.get(f"/fine_tuning/jobs/{job_id}/checkpoints/{ckpt['id']}/adapter")
            assert r.status_code == 200, (ckpt, r.text)

    # Same seed, never interrupted: the same loss curve and (within float noise) the same adapter.
    reference = stack.submit(EPOCHS)
    stack.assert_succeeded_once(reference, attempts=1)
    got, want = stack.losses(job_id), stack.losses(reference)
    assert got.keys() == want.keys()
    for s in want:
        assert got[s] == pytest.approx(want[s], rel=1e-4, abs=1e-5), (s, got[s], want[s])
    a, b = adapter_tensors(stack.adapter_bytes(job_id)), adapter_tensors(stack.adapter_bytes(reference))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_sigterm_checkpoints_at_the_current_step_and_the_job_resumes_elsewhere(stack: Stack) -> None:
    (first,) = stack.only_workers(1)
    job_id = stack.submit(EPOCHS)
    stack.wait(job_id, {"running"})
    stack.wait_checkpoint(job_id)
    t0 = time.monotonic()
    os.killpg(first.pid, signal.SIGTERM)  # Celery's warm shutdown
    first.wait(timeout=30)
    exit_s = time.monotonic() - t0
    job = stack.job(job_id)
    assert job["status"] == "queued", job  # the worker put it back itself, before exiting
    last_step = max(stack.metric_steps(job_id))
    assert last_step < EPOCHS * 4, "the job finished before SIGTERM; make it longer"
    with stack.client() as c:
        top = c.get(f"/fine_tuning/jobs/{job_id}/checkpoints").json()["data"][0]["step_number"]
    assert top == last_step  # the checkpoint holds every step it trained: nothing to redo
    assert exit_s < 15, exit_s
    events = stack.events(job_id)
    assert "Job re-queued: the worker shut down; the job resumes from its last checkpoint" in events

    second = stack.start_worker()
    done = stack.assert_succeeded_once(job_id, attempts=2)
    assert done["worker_id"].endswith(f":{second.pid}")
    assert f"Resumed from checkpoint at step {top}" in stack.events(job_id)


def test_sigstop_past_the_heartbeat_timeout_fences_the_frozen_worker(stack: Stack) -> None:
    (frozen,) = stack.only_workers(1)
    job_id = stack.submit(EPOCHS)
    stack.wait(job_id, {"running"})
    stack.wait_checkpoint(job_id)
    os.killpg(frozen.pid, signal.SIGSTOP)
    try:
        rescuer = stack.start_worker()
        # the reaper sees the silent heartbeat, re-queues the job and the rescuer claims attempt 2
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 60
        while not (stack.job(job_id)["worker_id"] or "").endswith(f":{rescuer.pid}"):
            assert time.monotonic() < deadline, stack.logs()
            time.sleep(0.1)
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    # Woken up, the frozen worker's next write carries a superseded attempt token: refused.
    deadline = time.monotonic() + 60
    while f"job={job_id} done: fenced" not in stack.worker_log(frozen):
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.1)
    done = stack.assert_succeeded_once(job_id, attempts=2)
    assert done["worker_id"].endswith(f":{rescuer.pid}")
    assert frozen.poll() is None  # and it goes on serving as a healthy worker


def test_redis_restart_with_jobs_queued_loses_none_and_runs_none_twice(stack: Stack) -> None:
    stack.only_workers(1)
    long_job = stack.submit(EPOCHS * 3)  # keeps the only worker busy across the restart
    stack.wait(long_job, {"running"})
    queued = [stack.submit(2) for _ in range(10)]
    assert stack.queue_length() == 10
    stack.kill_redis()
    stack.start_redis()  # empty: the 10 wake-ups are gone, the database still says `queued`
    assert stack.queue_length() == 0
    assert stack.job(long_job)["status"] == "running"
    for job_id in [long_job, *queued]:
        stack.assert_succeeded_once(job_id, attempts=1)  # attempt 1: none ran twice


def test_frozen_redis_submits_answer_in_bounded_time_and_every_job_runs(stack: Stack) -> None:
    """With the broker's redis-server stopped (SIGSTOP: a stalled disk or a paused VM),
    30 concurrent submits each answer within 5 s, /healthz and the job list keep answering, and
    after SIGCONT every job that exists is one whose caller was told about it, and it runs."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    stack.only_workers(1)
    api, file_id = stack.new_tenant("frozen", examples=4)  # one step a job: 30 jobs run in seconds
    headers = dict(api.headers)
    body = {
        "model": "tiny-llama",
        "training_file": file_id,
        "hyperparameters": {"n_epochs": 1, "batch_size": 4},
        "lora": {"r": 4, "alpha": 8},
        "max_seq_len": 128,
    }

    def submit(_: int) -> tuple[float, int, str | None]:
        t0 = time.monotonic()
        try:
            r = httpx.post(stack.url + "/v1/fine_tuning/jobs", json=body, headers=headers, timeout=15)
        except httpx.TimeoutException:
            return time.monotonic() - t0, 0, None
        return time.monotonic() - t0, r.status_code, r.json().get("id") if r.status_code == 200 else None

    assert stack.redis is not None
    os.kill(stack.redis.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(30) as pool:
            answers = list(pool.map(submit, range(30)))
        t0 = time.monotonic()
        assert httpx.get(stack.url + "/healthz", timeout=5).status_code == 200
        listed = api.get("/fine_tuning/jobs", params={"limit": 100})
        read_s = time.monotonic() - t0
    finally:
        os.kill(stack.redis.pid, signal.SIGCONT)
    slowest = max(s for s, _, _ in answers)
    print(f"frozen Redis: 30 concurrent submits, slowest {slowest:.2f}s; healthz + list {read_s:.2f}s")
    assert all(code == 200 for _, code, _ in answers), answers
    assert slowest < 5.0, answers
    assert listed.status_code == 200 and read_s < 5.0
    told = {job_id for _, _, job_id in answers}
    assert {j["id"] for j in listed.json()["data"]} == told
    deadline = time.monotonic() + 300
    for job_id in told:  # sent by the reconciler once Redis answers again; each runs once
        while (job := api.get(f"/fine_tuning/jobs/{job_id}").json())["status"] != "succeeded":
            assert job["status"] in ("queued", "running") and time.monotonic() < deadline, (job, stack.logs())
            time.sleep(0.2)
        assert job["error"] is None
    assert {j["id"] for j in api.get("/fine_tuning/jobs", params={"limit": 100}).json()["data"]} == told
    api.close()


def vm_hwm(pid: int) -> int:
    """Peak resident set size of a process (bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def test_512_mib_upload_with_a_100_mib_line_stays_within_1_gib(stack: Stack) -> None:
    """The whole service (API + worker + Redis) grows its peak RSS by at most 1 GiB
    while it takes a 512 MiB upload holding one 100 MiB line; the file says `error` naming that
    line, and a job on it is refused at submit. The upload is generated while it is sent."""
    import httpx

    (worker,) = stack.only_workers(1)
    assert stack.api is not None and stack.redis is not None
    pids = {"api": stack.api.pid, "worker": worker.pid, "redis": stack.redis.pid}
    before = {name: vm_hwm(pid) for name, pid in pids.items()}

    total, long_len = 512 << 20, 100 << 20
    good = json.dumps({"text": "y" * ((1 << 20) - 14)}).encode() + b"\n"  # a valid 1 MiB line
    head = b'{"text": "' + b"x" * (long_len - 12) + b'"}\n'
    boundary = "loraq17boundary"
    prefix = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    suffix = f"\r\n--{boundary}--\r\n".encode()
    n_good, rest = divmod(total - len(good) - len(head), len(good))
    tail_line = json.dumps({"text": "z" * (rest - 13)}).encode() + b"\n" if rest > 20 else b""

    def body() -> Iterator[bytes]:
        yield prefix
        yield good  # line 1 is fine; line 2 is the 100 MiB one
        for start in range(0, len(head), 1 << 20):
            yield head[start : start + (1 << 20)]
        for _ in range(n_good):
            yield good
        yield tail_line
        yield suffix

    size = len(good) + len(head) + n_good * len(good) + len(tail_line)
    headers = {
        "Authorization": f"Bearer {stack.key}",
        "Content-Type": f"multipart/form-data; boundary={boundary}",
        "Content-Length": str(len(prefix) + size + len(suffix)),
    }
    t0 = time.monotonic()
    r = httpx.post(stack.url + "/v1/files", content=body(), headers=headers, timeout=300)
    seconds = time.monotonic() - t0
    assert r.status_code == 200, r.text
    file = r.json()
    assert file["bytes"] == size and file["status"] == "error"
    assert file["status_details"].startswith(
        f"1 bad line(s): line 2: line is {len(head)} bytes, over the limit"
    )
    with stack.client() as c:
        refused = c.post(
            "/fine_tuning/jobs",
            json={"model": "tiny-llama", "training_file": file["id"], "max_seq_len": 128},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "training_file"
        summary = httpx.get(
            f"{stack.url}/dashboard/api/files/{file['id']}/summary",
            headers={"Authorization": f"Bearer {stack.key}"},
            timeout=120,
        )
        assert summary.status_code == 200 and summary.json()["bad_line_count"] == 1
    growth = {name: vm_hwm(pid) - before[name] for name, pid in pids.items()}
    print(
        f"{size >> 20} MiB upload, one {len(head) >> 20} MiB line: {seconds:.1f}s; peak RSS growth "
        + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in growth.items())
    )
    assert sum(growth.values()) <= 1 << 30, growth


def test_running_limit_holds_when_jobs_start_on_two_workers(stack: Stack) -> None:
    """With two idle workers and a running-job limit of 1, a tenant's second job does
    not start beside its first: it waits, saying why in its status and events, and starts when
    the first finishes."""
    for proc in stack.alive_workers():
        stop_process(proc, grace=20)
    limited = [stack.start_worker(LORAQ_MAX_RUNNING_JOBS_PER_TENANT="1") for _ in range(2)]
    api, file_id = stack.new_tenant("limited")
    body = {
        "model": "tiny-llama",
        "training_file": file_id,
        "hyperparameters": {"n_epochs": EPOCHS, "batch_size": 4},
        "lora": {"r": 4, "alpha": 8},
        "max_seq_len": 128,
    }
    try:
        ids = [api.post("/fine_tuning/jobs", json=body).json()["id"] for _ in range(2)]
        # Either job may win the slot: the two workers race to start them.
        deadline = time.monotonic() + 120
        seen_waiting, first, second = None, "", ""
        while time.monotonic() < deadline:
            jobs = {j: api.get(f"/fine_tuning/jobs/{j}").json() for j in ids}
            a, b = jobs.values()
            assert not (a["status"] == "running" and b["status"] == "running"), (a, b)
            for run, wait in ((a, b), (b, a)):
                if run["status"] == "running" and wait["status"] == "queued" and wait["waiting_for"]:
                    seen_waiting, first, second = wait["waiting_for"], run["id"], wait["id"]
            if seen_waiting and jobs[first]["status"] in TERMINAL:
                break
            time.sleep(0.05)
        assert seen_waiting and "running-job slot" in seen_waiting and "its limit is 1" in seen_waiting, (
            stack.logs()
        )
        events = [
            e["message"]
            for e in api.get(f"/fine_tuning/jobs/{second}/events", params={"limit": 100}).json()["data"]
        ]
        assert any(m.startswith("Waiting for a running-job slot") for m in events), events
        deadline = time.monotonic() + 120
        while (b := api.get(f"/fine_tuning/jobs/{second}").json())["status"] != "succeeded":
            assert b["status"] not in TERMINAL and time.monotonic() < deadline, (b, stack.logs())
            time.sleep(0.1)
        a = api.get(f"/fine_tuning/jobs/{first}").json()
        assert a["status"] == "succeeded" and b["waiting_for"] is None
        assert b["created_at"] <= a["finished_at"] <= b["finished_at"]
        with_pids = {a["worker_id"].rsplit(":", 1)[1], b["worker_id"].rsplit(":", 1)[1]}
        assert with_pids <= {str(p.pid) for p in limited}
    finally:
        api.close()
        for proc in limited:
            stop_process(proc, grace=20)
