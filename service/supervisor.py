"""Child processes of `loraq up`: start, watch, restart with backoff, stop.

Policy (what an operator running this on one box expects):
- A child that exits unexpectedly is restarted after a backoff of 0.5 s, doubling per exit up to
  30 s, and reset once the child has run `STABLE_SECONDS` without exiting; the others keep running.
- Each exit and restart is one log line (child, exit code or signal, log path), and a count per
  child in `<data_dir>/up.restarts.json`, which the API's /metrics serves as
  `loraq_up_restarts_total{child}` (the API outlives none of its own restarts, the file does).
- `CRASH_LOOP_EXITS` exits of one child within `CRASH_LOOP_WINDOW_S` is a crash loop: `poll()`
  raises `CrashLoopError` naming the child and the tail of its log, and the caller stops everything.
- A dependency outage is not a crash: an exit with `EXIT_DEPENDENCY_DOWN` (the child gave up on a
  dependency), or any exit while the child's `dependency` check says that dependency is down
  (Redis stalled or restarting), is restarted with the same backoff but never counted towards the
  crash-loop rule, so an outage of any length stops nothing that is healthy.
- Every child runs in its own process group (a terminal's Ctrl-C reaches only the supervisor,
  which stops the children together, and the first one started, the private Redis, last) and
  dies with the supervisor: the kernel sends it SIGKILL when the supervisor dies, even by
  `kill -9` (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.dependency import EXIT_DEPENDENCY_DOWN

GRACE_SECONDS = 15.0
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_SECONDS = 60.0  # a child up this long starts again from the first backoff
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW_S = 60.0
LOG_TAIL_LINES = 20
RESTARTS_FILE = "up.restarts.json"  # in the data dir; served by the API's /metrics
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class CrashLoopError(RuntimeError):
    """A child kept exiting; the message names it, how often, and the tail of its log."""


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn`: the child gets `sig` when the process that spawned it dies (Linux only).

    The parent's pid is taken now, in the parent: if it died between fork and prctl the child
    would never be signalled, so it checks and ends itself instead.
    """
    parent = os.getpid()

    def preexec() -> None:
        if not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
        return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: Path | None, lines: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.exists():
        return "(no log)"
    with path.open("rb") as fh:
        fh.seek(max(0, path.stat().st_size - 64 * 1024))
        text = fh.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path | None
    proc: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)
    exits: deque[float] = field(default_factory=lambda: deque(maxlen=CRASH_LOOP_EXITS))
    restarts: int = 0
    backoff: float = BACKOFF_FIRST_S
    restart_at: float | None = None  # set while the child is down and waiting for its restart
    # Why a dependency this child needs is down (e.g. "Redis does not answer"), or None while it is
    # up: asked when the child exits, so that an exit during an outage is not counted as a crash.
    dependency: Callable[[], str | None] | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass
class Supervisor:
    """Owns the child processes; `stop()` is idempotent and safe from a signal handler."""

    children: list[Child] = field(default_factory=list)
    pid_file: Path | None = None
    restarts_file: Path | None = None
    grace: float = GRACE_SECONDS
    echo: Callable[[str], None] = print
    # Called with (child, its dead pid) after an unexpected exit, before the restart is scheduled.
    on_exit: dict[str, Callable[[Child, int], None]] = field(default_factory=dict)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def spawn(
        self,
        name: str,
        argv: list[str],
        *,
        env: dict[str, str],
        log_path: Path | None,
        dependency: Callable[[], str | None] | None = None,
    ) -> Child:
        child = Child(name, argv, env, log_path, self._popen(argv, env, log_path), dependency=dependency)
        self.children.append(child)
        self._write_state()
        return child

    def _popen(self, argv: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen[bytes]:
        out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - the child holds it
        try:
            return subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        finally:
            if out is not None:
                out.close()

    def poll(self, now: float | None = None) -> None:
        """Notice exits and run due restarts; raises `CrashLoopError` on a crash loop."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is None and child.proc.poll() is not None:
                self._exited(child, now)
            elif child.restart_at is not None and now >= child.restart_at:
                self._restart(child, now)

    def _exited(self, child: Child, now: float) -> None:
        if now - child.started_at >= STABLE_SECONDS:
            child.backoff = BACKOFF_FIRST_S
        how = describe_exit(child.proc.returncode)
        where = f"log: {child.log_path}" if child.log_path else "no log"
        outage = self._outage(child)
        if outage is not None:
            how = f"{how} ({outage}: not counted as a crash)"
        else:
            child.exits.append(now)
        if len(child.exits) == CRASH_LOOP_EXITS and now - child.exits[0] <= CRASH_LOOP_WINDOW_S:
            raise CrashLoopError(
                f"{child.name} (pid {child.pid}) {how}: its {CRASH_LOOP_EXITS}th exit within "
                f"{CRASH_LOOP_WINDOW_S:g}s, so it is crash-looping; giving up ({where}). "
                f"Last lines of its log:\n{log_tail(child.log_path)}"
            )
        self.echo(f"{child.name} (pid {child.pid}) {how}; restarting in {child.backoff:g}s ({where})")
        hook = self.on_exit.get(child.name)
        if hook is not None:
            try:
                hook(child, child.pid)
            except Exception as e:  # the restart matters more than the hook; say what failed
                self.echo(f"{child.name}: after-exit step failed: {type(e).__name__}: {e}")
        child.restart_at = now + child.backoff
        child.backoff = min(child.backoff * 2, BACKOFF_MAX_S)

    @staticmethod
    def _outage(child: Child) -> str | None:
        """Why this exit is a dependency outage rather than a crash, or None."""
        if child.proc.returncode == EXIT_DEPENDENCY_DOWN:
            return "it gave up on a dependency"
        if child.dependency is None:
            return None
        try:
            return child.dependency()
        except Exception:  # a check that fails says nothing about the child: count the exit
            return None

    def _restart(self, child: Child, now: float) -> None:
        old = child.pid
        child.proc = self._popen(child.argv, child.env, child.log_path)
        child.started_at, child.restart_at = now, None
        child.restarts += 1
        self.echo(f"{child.name} restarted (pid {child.pid}, was {old}; restart {child.restarts})")
        self._write_state()

    def _write_state(self) -> None:
        if self.pid_file is not None:
            pids = {c.name: c.pid for c in self.children}
            _write_json(self.pid_file, {"supervisor": os.getpid(), **pids})
        if self.restarts_file is not None:
            _write_json(self.restarts_file, {c.name: c.restarts for c in self.children})

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        # The first child started (the private Redis, when there is one) stops last: the workers
        # ack into it. The others stop together, so stopping takes the slowest one's time, not
        # the sum of theirs.
        _terminate_groups(self.children[1:], self.grace)
        _terminate_groups(self.children[:1], self.grace)
        for path in (self.pid_file, self.restarts_file):
            if path is not None:
                path.unlink(missing_ok=True)


def _write_json(path: Path, data: dict[str, int]) -> None:
    # Replace, never truncate in place: the API's /metrics may read the file at any moment.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _terminate_groups(children: list[Child], grace: float) -> None:
    """SIGTERM each child's process group, then SIGKILL what is left `grace` seconds later."""
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    # A group may hold grandchildren (uvicorn reloader, celery pool) even after the leader exits.
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.proc.wait()
