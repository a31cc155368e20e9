"""`loraq worker --gpus`: input checks, the processes it plans, and a real run against Redis."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from service.settings import Settings
from tests.e2e.procs import clean_env, stop_process, wait_for
from worker import launcher

ROOT = Path(__file__).resolve().parents[2]


def test_celery_queue_names() -> None:
    assert launcher.celery_queue("h100") == "h100"
    assert launcher.celery_queue("h100", 2) == "h100-x2"
    with pytest.raises(launcher.LaunchError, match="queue"):
        launcher.celery_queue("h100 fast")
    with pytest.raises(launcher.LaunchError, match="n_gpus"):
        launcher.celery_queue("h100", 0)


def test_parse_and_group_gpus() -> None:
    assert launcher.parse_gpus("0,1, 3") == [0, 1, 3]
    assert launcher.parse_gpus("all", count_gpus=lambda: 4) == [0, 1, 2, 3]
    for bad in ("0,x", "", "0,0", "-1"):
        with pytest.raises(launcher.LaunchError, match="--gpus"):
            launcher.parse_gpus(bad)
    with pytest.raises(launcher.LaunchError, match="no GPU"):
        launcher.parse_gpus("all", count_gpus=lambda: 0)
    assert launcher.group_gpus([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    with pytest.raises(launcher.LaunchError, match="--gpus-per-job 3"):
        launcher.group_gpus([0, 1, 2, 3], 3)


def test_child_specs_pin_one_gpu_each() -> None:
    specs = launcher.child_specs([0, 1, 2, 3], queue="h100", base_env={}, base_port=9200)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2", "3"]
    assert {s.env["CUDA_DEVICE_ORDER"] for s in specs} == {"PCI_BUS_ID"}  # same numbering as NVML
    assert [s.env["LORAQ_WORKER_METRICS_PORT"] for s in specs] == ["9200", "9201", "9202", "9203"]
    assert {s.queue for s in specs} == {"h100"}
    assert specs[2].argv[-2:] == ["--hostname", "gpu2@%h"]
    pairs = launcher.child_specs([0, 1, 2, 3], queue="h100", per_job=2, base_env={})
    planned = [(s.env["CUDA_VISIBLE_DEVICES"], s.queue) for s in pairs]
    assert planned == [("0,1", "h100-x2"), ("2,3", "h100-x2")]


def test_worker_identity_names_host_and_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    host, gpu, pid = launcher.worker_identity(settings=Settings(worker_gpus="3")).split(
        ":"
    )  # from the launcher
    assert (gpu, pid) == ("gpu3", str(os.getpid())) and host
    alone = Settings(worker_gpus=None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert launcher.worker_identity(count_gpus=lambda: 0, settings=alone).split(":")[1] == "cpu"
    assert (
        launcher.worker_identity(count_gpus=lambda: 2, settings=alone).split(":")[1] == "gpu0"
    )  # torch's cuda:0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    assert launcher.worker_identity(settings=alone).split(":")[1] == "gpu5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # set but empty: CUDA sees no GPU
    assert launcher.worker_identity(settings=alone).split(":")[1] == "cpu"


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_launcher_runs_one_pinned_celery_worker_per_gpu_and_stops_all(redis_url: str, tmp_path: Path) -> None:
    """Two real Celery workers answer a broadcast ping as gpu0@host and gpu1@host; SIGINT stops both."""
    env = clean_env(
        LORAQ_REDIS_URL=redis_url,
        LORAQ_DATA_DIR=str(tmp_path),
        LORAQ_WORKER_METRICS_PORT="0",
        LORAQ_DATABASE_URL=f"sqlite:///{tmp_path / 'loraq.db'}",
    )
    queue = f"launch-{os.getpid()}"
    log = open(tmp_path / "launcher.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "worker", "--gpus", "0,1", "--queue", queue],
        env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        from celery import Celery

        app = Celery(broker=redis_url)
        replies: dict[str, object] = {}

        def both_answer() -> bool:
            for reply in app.control.ping(timeout=0.5):
                replies.update(reply)
            return sum(1 for n in replies if n.startswith(("gpu0@", "gpu1@"))) == 2

        wait_for(both_answer, "two pinned Celery workers", 90, proc)
        kids = _children(proc.pid)
        assert len(kids) == 2
        pinned = sorted(_environ(k)["CUDA_VISIBLE_DEVICES"] for k in kids)
        assert pinned == ["0", "1"]
        assert all(_environ(k)["LORAQ_WORKER_QUEUE"] == queue for k in kids)

        os.kill(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to the launcher
        assert proc.wait(timeout=60) == 0
        for k in kids:
            assert not Path(f"/proc/{k}").exists() or "zombie" in Path(f"/proc/{k}/status").read_text()
    except BaseException:
        log.flush()
        print((tmp_path / "launcher.log").read_text(errors="replace")[-5000:])
        raise
    finally:
        stop_process(proc)
        log.close()
