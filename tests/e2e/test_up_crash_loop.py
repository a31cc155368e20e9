"""`loraq up` gives up on a crash-looping child: it stops everything and exits non-zero, naming
the child and the tail of its log, and leaves its data dir free for the next start.

The child is the private Redis with a damaged append-only manifest: redis-server refuses to start
on it ("Invalid AOF manifest file format") and exits within milliseconds, so the five exits come
at the backoff's pace (0.5 + 1 + 2 + 4 s) and not at the pace of a Python child importing torch
(tens of seconds a start on a busy 2-core box, too slow to fit five exits in the 60 s window).
One SIGKILL (as from the OOM killer) makes it start again from that file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from service.supervisor import CRASH_LOOP_EXITS
from tests.e2e.procs import ROOT, clean_env, free_port, wait_for
from tests.e2e.test_up import alive, running_up

GIVE_UP_WITHIN_S = 30.0  # the backoffs sum to 7.5 s; the rest is stopping four children


def pids_now(data_dir: Path) -> set[int]:
    """The children `up.pids.json` names now (empty once `loraq up` removed it)."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):  # replaced, never truncated
        pids: dict[str, int] = json.loads((data_dir / "up.pids.json").read_text())
        return {pid for name, pid in pids.items() if name != "supervisor"}
    return set()


def processes_of(data_dir: Path) -> list[str]:
    """Every live process started for this data dir, restarted children and grandchildren (uvicorn,
    Celery pool) included: each inherits `LORAQ_DATA_DIR` from `loraq up`."""
    wanted = {str(data_dir), str(data_dir.resolve())}
    found = []
    for p in psutil.process_iter(["pid", "name", "status"]):
        if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get("LORAQ_DATA_DIR") in wanted:
                found.append(f"{p.pid} {p.info['name']}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_a_crash_looping_redis_stops_up_naming_it_and_leaves_nothing_behind(tmp_path: Path) -> None:
    with running_up(tmp_path) as (proc, _url, data_dir):
        children = json.loads((data_dir / "up.pids.json").read_text())
        assert children.pop("supervisor") == proc.pid
        assert set(children) == {"redis", "api", "worker", "inference"}
        seen = set(children.values())
        assert processes_of(data_dir), "the scan below would see no process at all"

        manifest = data_dir / "redis" / "appendonlydir" / "appendonly.aof.manifest"
        intact = manifest.read_bytes()
        manifest.write_text("not a manifest\n")  # read only at start: the running server is unaffected
        t0 = time.monotonic()
        os.kill(children["redis"], signal.SIGKILL)
        while proc.poll() is None and time.monotonic() - t0 < GIVE_UP_WITHIN_S + 30:
            seen |= pids_now(data_dir)  # every incarnation, to check each is gone
            time.sleep(0.02)
        rc = proc.wait(timeout=1)
        took = time.monotonic() - t0

        out = (tmp_path / "up.out").read_text(errors="replace")
        assert rc == 1 and took < GIVE_UP_WITHIN_S, (rc, took, out[-3000:])
        log = data_dir.resolve() / "redis" / "redis.log"
        lines = out.splitlines()
        restarts = [line for line in lines if line.startswith("redis (pid ")]
        assert [line.split("; ")[-1].split(" (")[0] for line in restarts] == [
            "restarting in 0.5s", "restarting in 1s", "restarting in 2s", "restarting in 4s",
        ], out  # fmt: skip
        assert restarts[0].startswith(f"redis (pid {children['redis']}) was killed by SIGKILL;")
        gave_up = next(line for line in lines if line.startswith("loraq up: redis (pid "))
        assert (
            f"exited with code 1: its {CRASH_LOOP_EXITS}th exit within 60s, so it is crash-looping; "
            f"giving up (log: {log})"
        ) in gave_up, out
        # the tail of its log, printed after the line that names it
        assert "Invalid AOF manifest file format" in out[out.index(gave_up) :], out
        assert "loraq up: stopping everything" in out

        assert not [pid for pid in seen if alive(pid)], (seen, out)
        wait_for(lambda: processes_of(data_dir) == [], "no process of this data dir left", 5)
        assert not (data_dir / "up.pids.json").exists()

    # The kernel dropped the lock with `loraq up`'s file: a next start may take it.
    with (data_dir / "up.lock").open("a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fh, fcntl.LOCK_UN)
    env = clean_env(LORAQ_DATA_DIR=str(data_dir), LORAQ_PORT=str(free_port()))
    # A start on the damaged manifest fails at once, showing why: the end of redis's log.
    refused = subprocess.run(
        [sys.executable, "-m", "service.cli", "up"], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    said = refused.stdout + refused.stderr
    assert refused.returncode == 1, said
    assert f"redis-server exited with code 1 while starting; the end of its log {log}:" in said
    assert "Invalid AOF manifest file format" in said
    assert processes_of(data_dir) == []
    # The operator restores the manifest; the next start on the same data dir comes up.
    manifest.write_bytes(intact)
    out_path = tmp_path / "second.out"
    with out_path.open("wb") as out_file:
        second = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "up"], env=env, cwd=ROOT, stdout=out_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: "Press Ctrl-C" in out_path.read_text(errors="replace"), "next start", 120, second)
    finally:
        second.send_signal(signal.SIGINT)
        rc = second.wait(timeout=60)
    assert rc == 0, out_path.read_text(errors="replace")
    assert processes_of(data_dir) == []
