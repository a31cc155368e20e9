"""The monitoring half of the compose stack hangs together: Prometheus scrapes the ports the API
and workers serve, Grafana's provisioned datasource is the one every dashboard panel names, and
the provisioning paths are where compose mounts them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from tests.servers import require_binary
from worker.metrics import DEFAULT_METRICS_PORT

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "docker/grafana"


def test_promtool_accepts_the_scrape_config() -> None:
    promtool = require_binary("promtool")
    out = subprocess.run(
        [promtool, "check", "config", str(ROOT / "docker/prometheus.yml")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_scrape_targets_match_the_compose_services() -> None:
    prom = yaml.safe_load((ROOT / "docker/prometheus.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    targets = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in prom["scrape_configs"]
    }
    assert targets["loraq-api"] == ["api:8000"]
    assert "8000" in compose["services"]["api"]["environment"]["LORAQ_PORT"]
    for target in targets["loraq-worker"]:
        service, port = target.split(":")
        assert service in compose["services"], target
        assert int(port) == DEFAULT_METRICS_PORT


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
