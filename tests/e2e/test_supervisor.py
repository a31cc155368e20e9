"""service/supervisor.py on real processes: restarts with backoff, the crash-loop give-up, the
restart count file, and children that die with their supervisor (even on SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from service.dependency import EXIT_DEPENDENCY_DOWN
from service.supervisor import CRASH_LOOP_EXITS, Child, CrashLoopError, Supervisor
from tests.e2e.procs import ROOT, wait_for


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_killed_child_is_restarted_and_the_others_keep_running(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor(restarts_file=tmp_path / "restarts.json", echo=lines.append, grace=1)
    try:
        victim = sup.spawn("worker", ["sleep", "300"], env=dict(os.environ), log_path=tmp_path / "w.log")
        other = sup.spawn("api", ["sleep", "300"], env=dict(os.environ), log_path=None)
        first_pid, other_pid = victim.pid, other.pid
        os.kill(first_pid, signal.SIGKILL)
        t0 = time.monotonic()
        while victim.pid == first_pid and time.monotonic() - t0 < 5:
            sup.poll()
            time.sleep(0.05)
        delay = time.monotonic() - t0
        assert victim.pid != first_pid and alive(victim.pid)
        assert 0.4 <= delay < 2.0, delay  # the first backoff is 0.5 s
        assert other.pid == other_pid and alive(other_pid)
        log = tmp_path / "w.log"
        assert lines[0] == f"worker (pid {first_pid}) was killed by SIGKILL; restarting in 0.5s (log: {log})"
        assert lines[1].startswith(f"worker restarted (pid {victim.pid}, was {first_pid}; restart 1)")
        assert json.loads((tmp_path / "restarts.json").read_text()) == {"worker": 1, "api": 0}
    finally:
        sup.stop()


@pytest.mark.serial  # each restart soon after its backoff: alone on the machine (8 s)
def test_a_crash_loop_gives_up_naming_the_child_and_its_log_tail(tmp_path: Path) -> None:
    lines: list[tuple[float, str]] = []
    sup = Supervisor(echo=lambda line: lines.append((time.monotonic(), line)), grace=1)
    log = tmp_path / "redis.log"
    argv = ["sh", "-c", "echo 'FATAL: cannot open the AOF'; exit 3"]
    sup.spawn("redis", argv, env=dict(os.environ), log_path=log)
    try:
        with pytest.raises(CrashLoopError) as err:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                sup.poll()
                time.sleep(0.01)
    finally:
        sup.stop()
    message = str(err.value)
    assert message.startswith("redis (pid ") and "exited with code 3" in message
    assert "5th exit within 60s" in message and str(log) in message
    assert "FATAL: cannot open the AOF" in message  # the tail of its log
    exits = [(t, line) for t, line in lines if "exited with code 3" in line]
    restarts = [t for t, line in lines if line.startswith("redis restarted")]
    assert [line.split("; ")[1].split(" (")[0] for _, line in exits] == [
        "restarting in 0.5s", "restarting in 1s", "restarting in 2s", "restarting in 4s",
    ]  # fmt: skip
    # 4 restarts between 5 exits, each after the announced backoff: 0.5, 1, 2, 4 s. Never early;
    # late by at most a quarter of the backoff plus 0.3 s. Lateness is CPU starvation of this
    # process (its 10 ms polls, the fork of each restart), not the supervisor's arithmetic:
    # `serial` stops other tests, not the servers other workers' fixtures keep running, and in a
    # fresh-clone CI run on 2 cores the 4 s wait ended 0.37 s late. A backoff twice the one
    # announced still fails (1 s > 0.5 x 1.25 + 0.3).
    for (exited, _), restarted, want in zip(exits, restarts, (0.5, 1.0, 2.0, 4.0), strict=True):
        assert want - 0.02 <= restarted - exited <= want * 1.25 + 0.3, (restarted - exited, want)


def test_children_die_with_their_supervisor_even_on_sigkill(tmp_path: Path) -> None:
    script = (
        "import json, os, sys, time\n"
        "from service.supervisor import Supervisor\n"
        "sup = Supervisor()\n"
        "kids = [sup.spawn(n, ['sleep', '300'], env=dict(os.environ), log_path=None) for n in ('a', 'b')]\n"
        "print(json.dumps([k.pid for k in kids]), flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())
    assert all(alive(pid) for pid in pids)
    proc.kill()
    proc.wait()
    # Each child is in its own session (a terminal's Ctrl-C never reaches it), so only the
    # parent-death signal can end it.
    wait_for(lambda: not any(alive(pid) for pid in pids), "children gone after kill -9 of the supervisor", 5)


def exits_until(sup: Supervisor, child: Child, exits: int) -> list[str]:
    """Poll on a clock of our own (one second a turn, so the backoffs pass at once) until `child`
    has exited `exits` times; returns the supervisor's lines. Raises what `poll` raises."""
    lines: list[str] = []
    sup.echo = lines.append
    now, deadline = 0.0, time.monotonic() + 30
    while sum("; restarting in" in line for line in lines) < exits:
        assert time.monotonic() < deadline, lines
        sup.poll(now)
        now += 1.0
        time.sleep(0.02)  # the restarted `sh` exits on its own
    return lines


def test_a_child_that_gives_up_on_a_dependency_is_restarted_and_never_a_crash_loop(tmp_path: Path) -> None:
    sup = Supervisor(grace=1)
    argv = ["sh", "-c", f"exit {EXIT_DEPENDENCY_DOWN}"]
    child = sup.spawn("worker", argv, env=dict(os.environ), log_path=tmp_path / "w.log")
    try:
        lines = exits_until(sup, child, CRASH_LOOP_EXITS * 2)  # twice what a crash loop takes
    finally:
        sup.stop()
    assert lines[0].endswith(
        f"exited with code {EXIT_DEPENDENCY_DOWN} (it gave up on a dependency: not counted as a crash); "
        f"restarting in 0.5s (log: {tmp_path / 'w.log'})"
    ), lines
    assert not child.exits  # none of them counted


@pytest.mark.parametrize("outage", ["Redis does not answer: TimeoutError", None], ids=["down", "up"])
def test_exits_while_a_dependency_is_down_are_not_counted(outage: str | None) -> None:
    sup = Supervisor(grace=1)
    argv = ["sh", "-c", "exit 1"]
    child = sup.spawn("inference", argv, env=dict(os.environ), log_path=None, dependency=lambda: outage)
    try:
        if outage is None:  # the dependency answers: the child is broken, and a crash loop is one
            with pytest.raises(
                CrashLoopError, match=r"inference \(pid \d+\) exited with code 1: its 5th exit"
            ):
                exits_until(sup, child, CRASH_LOOP_EXITS)
            return
        lines = exits_until(sup, child, CRASH_LOOP_EXITS * 2)
    finally:
        sup.stop()
    restarts = [line for line in lines if "; restarting in" in line]
    assert all(f"exited with code 1 ({outage}: not counted as a crash)" in line for line in restarts), lines
    assert not child.exits
