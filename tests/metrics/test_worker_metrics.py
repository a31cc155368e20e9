"""Worker metrics: NVML collector with and without NVML, and the multiprocess endpoint for real.

The endpoint test runs in a subprocess (tests/metrics/worker_child.py) because multiprocess mode
changes prometheus_client's global state, which must not leak into this pytest process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from service import worker_registry
from service.settings import Settings, get_settings
from tests.servers import shared_redis_url
from worker.metrics import gpus, live_jobs

ROOT = Path(__file__).resolve().parents[2]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def by_name(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(k[1]), v) for k, v in samples(text).items() if k[0] == name]


def test_without_nvml_no_gpu_series_and_no_error() -> None:
    # This host has no NVIDIA driver: pynvml is installed but nvmlInit fails.
    assert gpus.load_nvml() is None
    assert gpus.local_gpus() == []
    registry = CollectorRegistry()
    registry.register(gpus.NvmlCollector(node="n1"))
    text = generate_latest(registry).decode()
    assert "loraq_gpu" not in text


class FakeNvml:
    """Three GPUs in NVML's units (milliwatts, MHz); GPU 1 fails to read, like a GPU off the bus."""

    def nvmlInit(self) -> None:
        return None

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return index

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return f"GPU-{handle}"

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        return b"NVIDIA H100 80GB HBM3"  # older pynvml returns bytes

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        if handle == 1:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        return SimpleNamespace(used=10 * 2**30, total=80 * 2**30, free=70 * 2**30)

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        assert sensor == 0
        return 61

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return 312_500

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:
        assert clock_type == 1
        return 1980


@pytest.fixture
def settings_cache() -> Iterator[None]:
    """For tests that change LORAQ_ variables: no other test sees settings read under them."""
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.usefixtures("settings_cache")
def test_nvml_collector_units_and_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_WORKER_GPUS", "0,1")  # this worker owns GPUs 0 and 1, not 2
    get_settings.cache_clear()
    registry = CollectorRegistry()
    registry.register(gpus.NvmlCollector(FakeNvml(), node="host:1"))
    text = generate_latest(registry).decode()
    labels = {"worker": "host:1", "gpu": "0", "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3"}
    expected = {
        "loraq_gpu_utilization_percent": 87.0,
        "loraq_gpu_memory_used_bytes": 10 * 2**30,
        "loraq_gpu_memory_total_bytes": 80 * 2**30,
        "loraq_gpu_temperature_celsius": 61.0,
        "loraq_gpu_power_watts": 312.5,
        "loraq_gpu_sm_clock_hertz": 1.98e9,
    }
    for name, value in expected.items():
        # GPU 1 failed to read: only GPU 0 is reported, and nothing raised.
        assert by_name(text, name) == [(labels, value)], name


def test_metrics_port_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_WORKER_METRICS_PORT", "nine")
    with pytest.raises(ValidationError, match="worker_metrics_port\n  Input should be a valid integer"):
        Settings()
    monkeypatch.setenv("LORAQ_WORKER_METRICS_PORT", "70000")
    with pytest.raises(ValidationError, match="less than or equal to 65535"):
        Settings()
    monkeypatch.setenv("LORAQ_WORKER_METRICS_PORT", "9200")
    assert Settings().worker_metrics_port == 9200


def test_multiprocess_endpoint_and_registry(tmp_path: Path) -> None:
    job_id = f"ftjob-{uuid.uuid4().hex[:12]}"
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "LORAQ_DATA_DIR": str(tmp_path),
        "LORAQ_REDIS_URL": shared_redis_url(),
    }
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests/metrics/worker_child.py"), job_id],
        cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    r = redis.Redis.from_url(shared_redis_url())

    def step(expect: str) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == expect

    try:
        first = proc.stdout.readline().split()
        assert first[:1] == ["PORT"], (first, proc.stderr.read() if proc.stderr else "")
        port, node = int(first[1]), first[3]
        url = f"http://127.0.0.1:{port}/metrics"
        assert proc.stdout.readline().strip() == "MID"

        # Mid-job: the registry names the job; the child's values are merged by the main process.
        entry = json.loads(r.get(worker_registry.worker_key(node)) or "null")
        assert entry["metrics_port"] == port and entry["node"] == node
        assert entry["gpus"] == [] and entry["kernels"]["compiled"] is False
        assert json.loads(r.get(worker_registry.job_key(node)) or "null")["job_id"] == job_id
        mid = httpx.get(url, timeout=5).text

        step("CHILD 0")  # the job finished and the child exited
        assert r.get(worker_registry.job_key(node)) is None
        after_job = httpx.get(url, timeout=5).text

        step("MARKED")  # Celery's worker_process_shutdown for the child
        after_death = httpx.get(url, timeout=5).text
    finally:
        proc.stdin.write("\n\n\n")
        proc.stdin.flush()
        proc.wait(timeout=20)
    assert proc.returncode == 0

    job = {"job_id": job_id}
    got = samples(mid)
    assert by_name(mid, "loraq_train_loss") == [({**job, "model": "tiny-llama"}, 1.0)]
    assert by_name(mid, "loraq_train_valid_loss") == [
        ({**job, "model": "tiny-llama"}, 2.5)
    ]  # kept from step 2
    assert by_name(mid, "loraq_train_grad_norm") == [(job, 1.5)]
    assert by_name(mid, "loraq_train_clip_rate") == [(job, pytest.approx(2 / 3))]
    assert by_name(mid, "loraq_train_tokens_per_second") == [(job, 1003.0)]
    assert by_name(mid, "loraq_train_step") == [(job, 3.0)]
    assert by_name(mid, "loraq_train_total_steps") == [(job, 3.0)]
    assert got[("loraq_train_steps_total", frozenset())] == 3
    assert got[("loraq_train_clipped_steps_total", frozenset())] == 2
    assert got[("loraq_train_tokens_total", frozenset())] == 300
    assert got[("loraq_train_step_seconds_count", frozenset())] == 3
    assert got[("loraq_train_step_seconds_sum", frozenset())] == pytest.approx(0.6)
    assert by_name(mid, "loraq_worker_running_jobs") == [({}, 1.0)]
    assert by_name(mid, "loraq_gpu_kernels_compiled") == [({}, 0.0)]
    assert "loraq_jobs_finished_total" not in mid
    assert "loraq_gpu_utilization_percent" not in mid  # no NVML on this host

    # The job ended: outcome counted, duration observed; its final values stay for the grace period.
    got = samples(after_job)
    assert got[("loraq_jobs_finished_total", frozenset({("outcome", "succeeded")}))] == 1
    assert got[("loraq_job_duration_seconds_count", frozenset({("outcome", "succeeded")}))] == 1
    assert by_name(after_job, "loraq_worker_running_jobs") == [({}, 0.0)]
    assert by_name(after_job, "loraq_train_loss") == [({**job, "model": "tiny-llama"}, 1.0)]

    # Once the child is marked dead its live values go; counters and histograms stay.
    got = samples(after_death)
    assert by_name(after_death, "loraq_train_loss") == []
    assert got[("loraq_train_steps_total", frozenset())] == 3
    assert by_name(after_death, "loraq_gpu_kernels_compiled") == [({}, 0.0)]  # the main process's
    # After stop(), the multiprocess files and the registry entry are gone.
    assert not any((tmp_path / "prometheus").iterdir())
    assert r.get(worker_registry.worker_key(node)) is None


def test_live_job_files_expire_after_the_grace_period(tmp_path: Path) -> None:
    now = time.time()
    running = {"job_id": "a", "model": "m", "train_loss": 2.0, "step": 5}
    recent = {"job_id": "b", "model": "m", "train_loss": 1.5, "finished_at": now - 5}
    old = {
        "job_id": "c",
        "model": "m",
        "train_loss": 1.0,
        "finished_at": now - live_jobs.LIVE_JOB_GRACE_SECONDS - 1,
    }
    for pid, state in ((1, running), (2, recent), (3, old)):
        (tmp_path / f"live-job-{pid}.json").write_text(json.dumps(state))
    (tmp_path / "live-job-4.json").write_text("{truncated")  # never fails a scrape
    registry = CollectorRegistry()
    registry.register(live_jobs.LiveJobCollector(tmp_path))
    text = generate_latest(registry).decode()
    assert sorted(by_name(text, "loraq_train_loss"), key=lambda x: x[1]) == [
        ({"job_id": "b", "model": "m"}, 1.5),
        ({"job_id": "a", "model": "m"}, 2.0),
    ]
    assert by_name(text, "loraq_train_step") == [({"job_id": "a"}, 5.0)]  # absent keys: no sample
    assert not (tmp_path / "live-job-3.json").exists()  # expired: deleted


@pytest.mark.usefixtures("settings_cache")
def test_worker_reports_only_the_gpus_it_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    def owns(indices: str | None) -> None:  # LORAQ_WORKER_GPUS, read through the settings
        if indices is None:
            monkeypatch.delenv("LORAQ_WORKER_GPUS", raising=False)
        else:
            monkeypatch.setenv("LORAQ_WORKER_GPUS", indices)
        get_settings.cache_clear()

    owns(None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [g.index for g in gpus.read_gpus(FakeNvml())] == [0, 2]  # all readable GPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert [g.index for g in gpus.read_gpus(FakeNvml())] == [2]
    owns("0")  # the launcher's assignment wins
    assert [g.index for g in gpus.read_gpus(FakeNvml())] == [0]
    owns("all")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")  # UUIDs: cannot map, report all
    assert [g.index for g in gpus.read_gpus(FakeNvml())] == [0, 2]
