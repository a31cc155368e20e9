"""The two-host layout (docker/two-hosts/): `docker compose config` of the control host (compose.yaml
plus control.yaml) and of a GPU host (gpu-host.yaml), then what each host must reach and share."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.test_compose import REQUIRED_ENV, ROOT, compose_command

CONTROL = ["-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "docker/two-hosts/control.yaml")]
GPU_HOST = ["-f", str(ROOT / "docker/two-hosts/gpu-host.yaml")]
S3_ENV = {"LORAQ_S3_ACCESS_KEY_ID": "loraq", "LORAQ_S3_SECRET_ACCESS_KEY": "s3-secret"}
CONTROL_ENV = {**REQUIRED_ENV, **S3_ENV, "LORAQ_PRIVATE_ADDR": "10.0.0.5"}
GPU_ENV = {
    **S3_ENV,
    "POSTGRES_PASSWORD": "pw",
    "LORAQ_CONTROL_ADDR": "10.0.0.5",
    "LORAQ_WORKER_METRICS_ADVERTISE": "gpu-host-1",
}


def config(tmp_path: Path, files: list[str], env_vars: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd, env = compose_command(tmp_path)
    return subprocess.run(
        [*cmd, *files, "config", "--format", "json"],
        capture_output=True,
        text=True,
        env={**env, **env_vars},
        cwd=ROOT,
    )


def resolved(tmp_path: Path, files: list[str], env_vars: dict[str, str]) -> dict[str, Any]:
    out = config(tmp_path, files, env_vars)
    assert out.returncode == 0, out.stderr
    model: dict[str, Any] = json.loads(out.stdout)
    return model


def test_the_gpu_host_reaches_only_redis_the_database_and_the_store(tmp_path: Path) -> None:
    services = resolved(tmp_path, GPU_HOST, GPU_ENV)["services"]
    assert set(services) == {"worker", "inference"}
    for name, service in services.items():
        env = service["environment"]
        assert env["LORAQ_REDIS_URL"] == "redis://10.0.0.5:6379/0", name
        assert env["LORAQ_DATABASE_URL"].endswith("@10.0.0.5:5432/loraq"), name
        assert env["LORAQ_STORAGE_URL"] == "s3://loraq/artifacts", name
        assert env["LORAQ_S3_ENDPOINT_URL"] == "http://10.0.0.5:9000", name
        # no disk shared with the control host: its only volume is this host's own
        assert {v.get("source") for v in service["volumes"] if v["type"] == "volume"} == {"local-data"}, name
        assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    worker_ports = {p["published"] for p in services["worker"]["ports"]}
    inference_ports = {p["published"] for p in services["inference"]["ports"]}
    assert not worker_ports & inference_ports  # eight GPU processes' /metrics and the inference one
    assert "9120" in " ".join(services["inference"]["healthcheck"]["test"])


def test_the_control_host_publishes_what_gpu_hosts_reach_and_writes_to_the_bucket(tmp_path: Path) -> None:
    model = resolved(tmp_path, CONTROL, CONTROL_ENV)
    services = model["services"]
    assert {"redis", "postgres", "api", "minio", "minio-bucket"} <= set(services)
    for name, port in (("redis", 6379), ("postgres", 5432), ("minio", 9000)):
        (published,) = services[name]["ports"]
        assert (published["host_ip"], published["target"]) == ("10.0.0.5", port), name  # private only
    for name in ("api", "worker", "inference"):
        env = services[name]["environment"]
        assert env["LORAQ_STORAGE_URL"] == "s3://loraq/artifacts", name
        assert env["LORAQ_S3_ENDPOINT_URL"] == "http://minio:9000", name
    assert services["api"]["depends_on"]["minio-bucket"]["condition"] == "service_completed_successfully"
    # the bucket the GPU hosts write to is the one the control host creates
    assert "store/loraq" in " ".join(services["minio-bucket"]["command"])


@pytest.mark.parametrize(
    ("files", "env", "var"),
    [
        (GPU_HOST, GPU_ENV, "LORAQ_CONTROL_ADDR"),
        (GPU_HOST, GPU_ENV, "LORAQ_S3_SECRET_ACCESS_KEY"),
        (GPU_HOST, GPU_ENV, "LORAQ_WORKER_METRICS_ADVERTISE"),
        (CONTROL, CONTROL_ENV, "LORAQ_PRIVATE_ADDR"),
        (CONTROL, CONTROL_ENV, "LORAQ_S3_ACCESS_KEY_ID"),
    ],
)
def test_what_each_host_needs_is_required(
    tmp_path: Path, files: list[str], env: dict[str, str], var: str
) -> None:
    out = config(tmp_path, files, {k: v for k, v in env.items() if k != var})
    assert out.returncode != 0
    assert var in out.stderr
