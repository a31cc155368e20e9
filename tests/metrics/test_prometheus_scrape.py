"""A real Prometheus server (Debian's `prometheus` binary, started here on a free port with a
generated config and a temporary TSDB) scrapes the API and a worker while a tiny-llama job runs;
the training, job, queue and request series are then read back through Prometheus' query API."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service import worker_registry
from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service, free_port, stop_process, wait_for
from tests.servers import require_binary

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_INTERVAL = "1s"
# The job must stay `running` across several scrapes: 128 tiny-llama steps take about 4 s here
# (24 steps, 0.75 s, once slipped between two scrapes and the running state was never seen).
TRAIN_EXAMPLES, BATCH, N_EPOCHS = 32, 4, 16
STEPS = TRAIN_EXAMPLES // BATCH * N_EPOCHS


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(base URL, config path): a Prometheus that reloads its config on POST /-/reload."""
    binary = require_binary("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": []}))
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        stdout=(tmp_path / "prometheus.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(url + "/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, "prometheus", 60, proc)
        yield url, config
    finally:
        stop_process(proc)


def worker_metrics_target(svc: Service, redis_url: str) -> str:
    """host:port of this test's worker, from the registry it writes to Redis."""
    client = redis.Redis.from_url(redis_url)
    queue = svc.env["LORAQ_WORKER_QUEUE"]
    found: list[str] = []

    def registered() -> bool:
        found[:] = [f"127.0.0.1:{w['metrics_port']}" for w in worker_registry.list_workers(client)
                    if w["queue"] == queue]  # fmt: skip
        return bool(found)

    wait_for(registered, "worker registry entry", 30)
    return found[0]


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def wait_query(prom: str, expr: str, timeout: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(prom, expr)
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"no series for {expr!r} after {timeout}s")


def test_prometheus_scrapes_api_and_worker_during_a_job(
    stack: Service, stack_redis_url: str, prometheus: tuple[str, Path]
) -> None:
    svc = stack
    prom, config = prometheus
    api_target = svc.url.removeprefix("http://")
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": SCRAPE_INTERVAL},
                "scrape_configs": [
                    {
                        "job_name": "loraq-api",
                        # as docker/prometheus.yml: the token file, here the one the API made
                        "authorization": {"credentials_file": str(svc.data_dir / "metrics_token")},
                        "static_configs": [{"targets": [api_target]}],
                    },
                    {
                        "job_name": "loraq-worker",
                        "static_configs": [{"targets": [worker_metrics_target(svc, stack_redis_url)]}],
                    },
                ],
            }
        )
    )
    assert httpx.post(prom + "/-/reload", timeout=10).status_code == 200
    wait_query(prom, 'up{job="loraq-api"} == 1')
    wait_query(prom, 'up{job="loraq-worker"} == 1')

    with svc.client() as c:
        files = {}
        for name, data in (("train", chat_lines(TRAIN_EXAMPLES)), ("valid", chat_lines(4))):
            r = c.post("/files", data={"purpose": "fine-tune"}, files={"file": (f"{name}.jsonl", data)})
            files[name] = r.json()["id"]
        body = {"model": "tiny-llama", "training_file": files["train"], "validation_file": files["valid"],
                "packing": False, "hyperparameters": {"n_epochs": N_EPOCHS, "batch_size": BATCH}}  # fmt: skip
        job_id = c.post("/fine_tuning/jobs", json=body).json()["id"]

    # While it runs: the worker's live training series and the API's view of the job. Prometheus
    # keeps what it scraped, so `max_over_time` still sees the running state once the job is done.
    svc.wait_job(job_id, {"running", "succeeded"})
    running = wait_query(prom, f'loraq_train_loss{{job_id="{job_id}", model="tiny-llama"}}')
    assert running[0]["metric"]["job"] == "loraq-worker"
    done = svc.wait_job(job_id, {"succeeded"})
    wait_query(prom, 'max_over_time(loraq_jobs{status="running"}[5m]) == 1')
    wait_query(prom, "max_over_time(loraq_worker_running_jobs[5m]) == 1")
    assert done["progress"]["step"] == done["progress"]["total_steps"] == STEPS

    outcome = done["status"]
    wait_query(prom, f'loraq_jobs_finished_total{{outcome="{outcome}"}} == 1')
    wait_query(prom, f'loraq_jobs{{status="{outcome}"}} == 1')
    wait_query(prom, f"loraq_train_steps_total == {STEPS}")
    wait_query(prom, "loraq_worker_running_jobs == 0")
    wait_query(prom, f'loraq_train_valid_loss{{job_id="{job_id}"}} > 0')
    for expr in (
        "loraq_train_step_seconds_count > 0",
        "loraq_train_tokens_total > 0",
        f'loraq_train_tokens_per_second{{job_id="{job_id}"}} > 0',
        f'loraq_train_grad_norm{{job_id="{job_id}"}}',
        f'loraq_train_clip_rate{{job_id="{job_id}"}}',
        f'loraq_job_duration_seconds_count{{outcome="{outcome}"}} == 1',
        "loraq_gpu_kernels_compiled == 0",  # CPU host: the reference path
        'loraq_queue_depth{job="loraq-api"}',
        'loraq_files_stored{job="loraq-api"} >= 1',
        'loraq_http_requests_total{route="/v1/fine_tuning/jobs", method="POST", status="200"} == 1',
        'loraq_http_request_duration_seconds_count{route="/v1/fine_tuning/jobs/{fine_tuning_job_id}"} > 0',
        "loraq_workers_alive >= 1",
    ):
        wait_query(prom, expr, timeout=30)
    assert query(prom, "loraq_gpu_utilization_percent") == []  # no NVML here: absent, not an error

    # Every series the Grafana dashboard plots exists (GPU ones only where NVML does).
    dashboard = (ROOT / "docker/grafana/dashboards/loraq.json").read_text()
    names = set(re.findall(r"\bloraq_[a-z_]+", dashboard))
    assert len(names) >= 15
    for name in sorted(names):
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        if base.startswith("loraq_gpu_") and base != "loraq_gpu_kernels_compiled":
            continue
        assert query(prom, f"count({name})"), f"the Grafana dashboard plots {name}, which nobody exports"
