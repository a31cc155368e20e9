"""The monitoring half of the compose stack hangs together: Prometheus scrapes the ports the API
and workers serve, Grafana's provisioned datasource is the one every dashboard panel names, and
the provisioning paths are where compose mounts them."""

from __future__ import annotations

import fnmatch
import json
import socket
import subprocess
from pathlib import Path

import yaml

from service.settings import Settings
from tests.servers import require_binary
from worker import launcher

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker/grafana"
SECRET_FILE = "/run/secrets/loraq_metrics_token"  # compose mounts secrets under /run/secrets


def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    """promtool also checks that the API's token file exists: here it is a file of this test's,
    where compose mounts the secret in the Prometheus container."""
    promtool = require_binary("promtool")
    token = tmp_path / "token"
    token.write_text("t")
    config = tmp_path / "prometheus.yml"
    config.write_text((ROOT / "docker/prometheus.yml").read_text().replace(SECRET_FILE, str(token)))
    out = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_sends_the_api_its_metrics_token() -> None:
    """The API's /metrics wants LORAQ_METRICS_BEARER_TOKEN, which compose requires and hands to
    Prometheus as a secret, the file its scrape of the API sends."""
    prom = yaml.safe_load((ROOT / "docker/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    (api_job,) = [job for job in prom["scrape_configs"] if job["job_name"] == "loraq-api"]
    assert api_job["authorization"] == {"type": "Bearer", "credentials_file": SECRET_FILE}
    env = compose["services"]["api"]["environment"]
    assert env["LORAQ_METRICS_BEARER_TOKEN"].startswith("${LORAQ_METRICS_BEARER_TOKEN:?")
    name = SECRET_FILE.removeprefix("/run/secrets/")
    assert compose["services"]["prometheus"]["secrets"] == [name]
    assert compose["secrets"][name] == {"environment": "LORAQ_METRICS_BEARER_TOKEN"}


def test_scrape_targets_match_the_compose_services() -> None:
    prom = yaml.safe_load((ROOT / "docker/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    jobs = {job["job_name"]: job for job in prom["scrape_configs"]}
    static = {
        name: [t for sc in job.get("static_configs", []) for t in sc["targets"]] for name, job in jobs.items()
    }
    assert static["loraq-api"] == ["api:8000"]
    assert "8000" in compose["services"]["api"]["environment"]["LORAQ_PORT"]
    default_port = Settings.model_fields["worker_metrics_port"].default
    assert static["loraq-worker-cpu"] == [f"worker-cpu:{default_port}"]
    # GPU workers: file-based discovery over the data volume that the workers write to
    (sd,) = jobs["loraq-worker"]["file_sd_configs"]
    (pattern,) = sd["files"]
    assert "loraq-data:/data:ro" in compose["services"]["prometheus"]["volumes"]
    assert "loraq-data:/data" in compose["services"]["worker"]["volumes"]
    data_dir = compose["x-loraq-env"]["LORAQ_DATA_DIR"]
    written = Settings(data_dir=Path(data_dir)).resolved_prometheus_targets_dir / "worker-host.json"
    assert fnmatch.fnmatch(str(written), pattern), (written, pattern)


def test_a_4_gpu_worker_writes_one_scrape_target_per_gpu(tmp_path: Path) -> None:
    """What `loraq worker --gpus 0,1,2,3` writes for Prometheus: four targets on consecutive ports,
    each labelled with its GPU; as file_sd JSON, in the directory compose's Prometheus reads."""
    specs = launcher.child_specs([0, 1, 2, 3], queue="h100", base_env={})
    path = launcher.write_scrape_targets(specs, tmp_path, "10.0.0.7")
    assert path == tmp_path / f"{socket.gethostname()}.json"
    assert json.loads(path.read_text()) == [
        {"targets": [f"10.0.0.7:{9108 + i}"], "labels": {"gpu": str(i), "queue": "h100", "worker": f"gpu{i}"}}
        for i in range(4)
    ]
    pairs = launcher.child_specs([0, 1, 2, 3], queue="h100", per_job=2, base_env={}, base_port=9300)
    assert launcher.scrape_targets(pairs, "gpu-host") == [
        {"targets": ["gpu-host:9300"], "labels": {"gpu": "0,1", "queue": "h100-x2", "worker": "gpu0-1"}},
        {"targets": ["gpu-host:9301"], "labels": {"gpu": "2,3", "queue": "h100-x2", "worker": "gpu2-3"}},
    ]
    free_ports = launcher.child_specs([0, 1], queue="h100", base_env={}, base_port=0)
    assert launcher.scrape_targets(free_ports, "gpu-host") == []  # a port chosen later cannot be listed


def test_grafana_provisioning_and_dashboard() -> None:
    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/loraq.yml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./docker/grafana/dashboards:{provider['options']['path']}:ro" in mounts
    assert "./docker/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts

    dashboard = json.loads((GRAFANA / "dashboards/loraq.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Training loss", "Tokens per second", "GPU utilisation", "GPU memory", "Queue depth"):
        assert wanted in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
