"""One Celery worker process per GPU (or per group of GPUs) on one host, and queue naming.

`loraq worker --gpus 0,1,2,3` runs four `loraq worker` children. Each child sees only its own
GPU (`CUDA_VISIBLE_DEVICES` pinned), is its own Celery node (`gpu0@host`, ...), serves its own
Prometheus port (`LORAQ_WORKER_METRICS_PORT` + slot) and takes one job at a time, so one job
runs per GPU. `--gpus-per-job 2` groups the GPUs in pairs instead: two children, each owning two
GPUs and consuming the `<queue>-x2` queue, where jobs that ask for `n_gpus: 2` are sent; such a
job runs under torchrun across its child's GPUs.

Ctrl-C or SIGTERM stops every child: SIGTERM to each process group (Celery's warm shutdown ends
the current task, and `acks_late` returns an unfinished job's message to the queue), then SIGKILL
after a grace period. A child that dies on its own is restarted after `RESTART_DELAY_SECONDS`, so
one crashed GPU does not stop the jobs on the others.

This module never imports torch. Queue naming (`celery_queue`) lives in service/broker.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.broker import RoutingError, celery_queue
from service.settings import Settings, get_settings

log = logging.getLogger("loraq.worker.launcher")

GRACE_SECONDS = 60.0
RESTART_DELAY_SECONDS = 5.0


# One error for bad `--gpus`/`--gpus-per-job`/queue input, here and in service.broker.celery_queue.
LaunchError = RoutingError


def parse_gpus(spec: str, count_gpus: Callable[[], int] | None = None) -> list[int]:
    """`"0,1,3"` -> `[0, 1, 3]`; `"all"` -> every GPU NVML sees on this host."""
    spec = spec.strip()
    if spec == "all":
        n = (count_gpus or nvml_gpu_count)()
        if n == 0:
            raise LaunchError("--gpus all: no GPU visible (NVML found none); use `loraq worker --queue cpu`")
        return list(range(n))
    try:
        gpus = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise LaunchError(f"--gpus: {spec!r} is not 'all' or a comma-separated list like 0,1,2,3") from None
    if not gpus:
        raise LaunchError("--gpus: empty list")
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise LaunchError(f"--gpus: {spec!r} must list distinct non-negative GPU indices")
    return gpus


def nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: no GPUs
        return 0


def group_gpus(gpus: Sequence[int], per_job: int) -> list[tuple[int, ...]]:
    """`[0, 1, 2, 3]`, 2 -> `[(0, 1), (2, 3)]`: the GPUs each child owns."""
    if per_job < 1:
        raise LaunchError(f"--gpus-per-job must be >= 1, got {per_job}")
    if len(gpus) % per_job:
        raise LaunchError(f"--gpus-per-job {per_job} does not divide the {len(gpus)} GPUs of --gpus")
    return [tuple(gpus[i : i + per_job]) for i in range(0, len(gpus), per_job)]


def worker_identity(count_gpus: Callable[[], int] | None = None, settings: Settings | None = None) -> str:
    """`host:gpu2:pid` (or `host:gpu2,3:pid`, `host:cpu:pid`): stored on the job that this process runs.

    Started by the launcher: the GPUs it was given (`worker_gpus`). Started alone: the GPU torch
    trains on (the first visible one), or `cpu` when there is none.
    """
    gpus = (settings or get_settings()).worker_gpus
    if not gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # CUDA's own variable, not a setting
        if visible is not None:
            gpus = visible.split(",")[0].strip()
        elif (count_gpus or nvml_gpu_count)() > 0:
            gpus = "0"
    where = f"gpu{gpus}" if gpus else "cpu"
    return f"{socket.gethostname()}:{where}:{os.getpid()}"


@dataclass(frozen=True)
class ChildSpec:
    slot: int
    gpus: tuple[int, ...]
    queue: str
    argv: list[str]
    env: dict[str, str]

    @property
    def name(self) -> str:
        return f"gpu{'-'.join(map(str, self.gpus))}"


def child_specs(
    gpus: Sequence[int],
    *,
    queue: str,
    per_job: int = 1,
    loglevel: str = "INFO",
    base_env: dict[str, str] | None = None,
    base_port: int | None = None,
    python: str = sys.executable,
) -> list[ChildSpec]:
    """The processes `loraq worker --gpus ...` starts; pure, so tests can check them. Each child
    gets this process's environment (or `base_env`) plus its own settings, as LORAQ_ variables:
    its GPUs, queue and metrics port (`base_port`, default the settings', + its slot)."""
    env0 = dict(os.environ if base_env is None else base_env)
    if base_port is None:
        base_port = get_settings().worker_metrics_port
    target_queue = celery_queue(queue, per_job)
    specs = []
    for slot, group in enumerate(group_gpus(gpus, per_job)):
        devices = ",".join(map(str, group))
        name = f"gpu{'-'.join(map(str, group))}"
        env = dict(
            env0,
            # Indices as nvidia-smi/NVML number them (CUDA's default order is "fastest first").
            CUDA_DEVICE_ORDER="PCI_BUS_ID",
            CUDA_VISIBLE_DEVICES=devices,
            LORAQ_WORKER_GPUS=devices,
            LORAQ_WORKER_QUEUE=target_queue,
            # 0 keeps "pick a free port" for every child; otherwise one port per child.
            LORAQ_WORKER_METRICS_PORT=str(base_port + slot if base_port else 0),
            PYTHONUNBUFFERED="1",
        )
        argv = [
            python, "-m", "service.cli", "worker",
            "--queue", target_queue, "--loglevel", loglevel, "--hostname", f"{name}@%h",
        ]  # fmt: skip
        specs.append(ChildSpec(slot, group, target_queue, argv, env))
    return specs


def advertised_host() -> str:
    """The name Prometheus reaches this host at: `LORAQ_WORKER_METRICS_ADVERTISE`, else this
    host's address (a compose container's IP on its network), else its host name."""
    configured = get_settings().worker_metrics_advertise
    if configured:
        return configured
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        address = socket.gethostbyname(name)
        if not address.startswith("127."):
            return address
    return name


def scrape_targets(specs: Sequence[ChildSpec], host: str) -> list[dict[str, Any]]:
    """Prometheus file_sd entries: one target per worker process (its own metrics port), labelled
    with its GPUs and queue so each GPU's series stay apart. A port of 0 (a free port, chosen by
    the child) cannot be known here; such children are left out."""
    entries = []
    for spec in specs:
        port = int(spec.env["LORAQ_WORKER_METRICS_PORT"])
        if port:
            labels = {"gpu": spec.env["LORAQ_WORKER_GPUS"], "queue": spec.queue, "worker": spec.name}
            entries.append({"targets": [f"{host}:{port}"], "labels": labels})
    return entries


def write_scrape_targets(specs: Sequence[ChildSpec], directory: Path, host: str) -> Path:
    """Write this host's targets to `<directory>/<hostname>.json` (replaced atomically, so
    Prometheus never reads half a file); the caller removes it when the workers stop."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{socket.gethostname()}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(scrape_targets(specs, host), indent=1))
    tmp.replace(path)
    return path


def _start(spec: ChildSpec) -> subprocess.Popen[bytes]:
    # Own process group: the terminal's Ctrl-C reaches only this launcher, which stops children
    # in order; and killpg also reaches a child's own children (torchrun ranks).
    proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, start_new_session=True)
    log.info("started %s (pid %d) on queue %s, CUDA_VISIBLE_DEVICES=%s", spec.name, proc.pid, spec.queue,
             spec.env["CUDA_VISIBLE_DEVICES"])  # fmt: skip
    return proc


def _stop_all(procs: dict[int, subprocess.Popen[bytes]], grace: float) -> None:
    for proc in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_workers(specs: Sequence[ChildSpec], *, grace: float = GRACE_SECONDS) -> int:
    """Start every child, restart any that dies, stop all on SIGINT/SIGTERM. Returns 0."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    targets = write_scrape_targets(specs, get_settings().resolved_prometheus_targets_dir, advertised_host())
    try:
        for spec in specs:
            procs[spec.slot] = _start(spec)
        restart_at: dict[int, float] = {}
        while not stopping:
            time.sleep(0.2)
            now = time.monotonic()
            for spec in specs:
                proc = procs[spec.slot]
                if proc.poll() is None:
                    continue
                if spec.slot not in restart_at:
                    log.error("%s exited with %s; restarting in %.0fs", spec.name, proc.returncode,
                              RESTART_DELAY_SECONDS)  # fmt: skip
                    restart_at[spec.slot] = now + RESTART_DELAY_SECONDS
                elif now >= restart_at.pop(spec.slot):
                    procs[spec.slot] = _start(spec)
        return 0
    finally:
        for s in previous:
            signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C must not strand children
        _stop_all(procs, grace)
        targets.unlink(missing_ok=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        log.info("all worker processes stopped")
