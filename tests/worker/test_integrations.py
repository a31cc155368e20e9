"""A job's integrations, logged by the worker (in-process `worker.runner` on tiny-llama, a real
database): a real `mlflow server` process (SQLite backend under tmp) read back through MLflow's
client, and W&B in offline mode, whose run file is read back record by record."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from service.db.models import JobMetric
from service.db.session import session_scope
from service.settings import get_settings
from tests.e2e.datasets import chat_lines
from tests.servers import MlflowServer, start_mlflow
from tests.worker.conftest import WorkerEnv
from tests.worker.test_pause import pause_at_step
from tests.worker.test_runner import events, explain, job_row
from worker import runner

INTEGRATIONS = [
    {"type": "wandb", "wandb": {"project": "loraq-tests", "name": "pirate", "tags": ["ci"]}},
    {"type": "mlflow", "mlflow": {"experiment": "loraq-tests"}},
]
W_AND_B_BLOCK, W_AND_B_HEADER = 32768, 7  # the .wandb file: LevelDB-log blocks of 7-byte-headed records


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf `Record`s of a W&B run file (LevelDB log format: a 7-byte file header, then
    records of crc32 (4) + length (2) + type (1: full, 2: first, 3: middle, 4: last), never
    straddling a 32 KiB block's last 6 bytes)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    i, parts = W_AND_B_HEADER, b""
    while i + W_AND_B_HEADER <= len(data):
        if W_AND_B_BLOCK - i % W_AND_B_BLOCK < W_AND_B_HEADER:
            i += W_AND_B_BLOCK - i % W_AND_B_BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[i : i + W_AND_B_HEADER])
        if kind == 0:
            break
        parts += data[i + W_AND_B_HEADER : i + W_AND_B_HEADER + length]
        i += W_AND_B_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(parts)
            parts = b""
            yield record


def key(item: Any) -> str:
    """A config or history item's key (wandb-core fills either `key` or the `nested_key` path)."""
    return str(item.key) or ".".join(item.nested_key)


def wandb_run(data_dir: Path, job_id: str) -> dict[str, Any]:
    """What the job's offline W&B runs (one per attempt) recorded: run ids, names, tags, config
    and history rows, in order."""
    import json

    found: dict[str, Any] = {"ids": set(), "names": set(), "tags": set(), "config": {}, "history": []}
    files = sorted((data_dir / "wandb" / job_id).glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no W&B run under {data_dir / 'wandb' / job_id}"
    for path in files:
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["ids"].add(record.run.run_id)
                found["names"].add(record.run.display_name)
                found["tags"].update(record.run.tags)
            elif kind == "config":
                found["config"].update({key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                found["history"].append({key(i): json.loads(i.value_json) for i in record.history.item})
    return found


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    server = start_mlflow(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def stored_losses(job_id: str) -> dict[int, float]:
    with session_scope() as s:
        rows = s.execute(select(JobMetric.step, JobMetric.train_loss).where(JobMetric.job_id == job_id))
        return {int(step): float(loss) for step, loss in rows}


@pytest.mark.slow
@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_a_paused_and_resumed_job_logs_each_step_once_to_mlflow_and_wandb(
    worker_env: WorkerEnv, mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline needs none; never from the request
    monkeypatch.setenv("LORAQ_MLFLOW_TRACKING_URI", mlflow_server.url)
    get_settings.cache_clear()
    hp = {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5.0}  # 8 steps
    job_id = worker_env.create_job(
        worker_env.upload(chat_lines(16)), hyperparameters=hp, integrations=INTEGRATIONS
    )
    with monkeypatch.context() as m:
        pause_at_step(m, worker_env.tenant_id, 3)
        assert runner.run_claimed_job(job_id) == "paused", explain(job_id)
    client = MlflowClient(mlflow_server.url)
    experiment = client.get_experiment_by_name("loraq-tests")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "RUNNING"  # a paused job's run stays open for the resume

    from service import jobs

    with session_scope() as s:
        jobs.request_resume(s, tenant_id=worker_env.tenant_id, job_id=job_id)
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)
    assert not [e.message for e in events(job_id) if e.level == "warn" and "integration" in e.message]
    losses = stored_losses(job_id)
    assert sorted(losses) == list(range(1, 9))

    # MLflow: one run for both attempts, every step once with the stored loss, the job's config
    # and its resolved plan as params, ended FINISHED.
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == job_id
    assert run.data.tags["loraq.job_id"] == job_id
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert {m.step: m.value for m in history} == losses and len(history) == len(losses)
    assert len(client.get_metric_history(run.info.run_id, "lr")) == len(losses)
    params = run.data.params
    assert params["model"] == "tiny-llama" and params["lora.r"] == "4" and params["job_id"] == job_id
    assert params["plan.n_epochs"] == "2" and params["plan.batch_size"] == "4"

    # W&B (offline): the same run id for both attempts, named and tagged as asked, each step once.
    wandb = wandb_run(worker_env.data_dir, job_id)
    assert wandb["ids"] == {job_id.removeprefix("ftjob-")} and wandb["names"] == {"pirate"}
    assert {"ci", "loraq/finetune", "loraq/tiny-llama", f"loraq/{job_id}"} <= wandb["tags"]
    assert wandb["config"]["model"] == "tiny-llama" and wandb["config"]["lora"]["r"] == 4
    assert wandb["config"]["plan"]["n_epochs"] == 2
    logged = {row["_step"]: row["train_loss"] for row in wandb["history"]}
    assert logged == losses and len(wandb["history"]) == len(losses)


@pytest.mark.parametrize("worker_env", ["sqlite"], indirect=True)
def test_an_integration_that_cannot_log_is_a_warning_and_never_fails_the_job(
    worker_env: WorkerEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No W&B key nor offline mode, no MLflow server: each integration says so once; a tracking
    server that does not answer is one warning too. The job succeeds either way."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("LORAQ_MLFLOW_TRACKING_URI", raising=False)
    get_settings.cache_clear()
    file_id = worker_env.upload(chat_lines(8))
    job_id = worker_env.create_job(file_id, integrations=INTEGRATIONS)
    assert runner.run_claimed_job(job_id) == "succeeded", explain(job_id)
    warnings = [e.message for e in events(job_id) if e.level == "warn" and "log to" in e.message]
    assert warnings == [
        "This worker cannot log to wandb (it needs WANDB_API_KEY or WANDB_MODE=offline and the "
        "`integrations` extra); the job trains on",
        "This worker cannot log to mlflow (it needs LORAQ_MLFLOW_TRACKING_URI and the `integrations` "
        "extra); the job trains on",
    ]

    # A tracking server that refuses (nothing listens there): the run cannot start; trains on.
    from service.supervisor import free_port

    monkeypatch.setenv("LORAQ_MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    get_settings.cache_clear()
    other = worker_env.create_job(file_id, seed=2, integrations=INTEGRATIONS[1:])
    assert runner.run_claimed_job(other) == "succeeded", explain(other)
    (warning,) = [e.message for e in events(other) if e.level == "warn" and "integration" in e.message]
    assert warning.startswith("The mlflow integration could not start: ") and warning.endswith("trains on")
    assert job_row(other).status == "succeeded"


class Recording:
    """A `MetricSink` that records what it is given, or raises from `log_steps` once `broken`."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.calls: list[tuple[str, Any]] = []

    def log_config(self, config: dict[str, Any]) -> None:
        self.calls.append(("config", config))

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        if self.broken:
            raise ConnectionError("tracking server\n  went away")
        self.calls.append(("steps", [row["step"] for row in rows]))

    def close(self, status: str) -> None:
        self.calls.append(("close", status))


def test_a_sink_that_fails_mid_run_is_dropped_with_one_warning_and_the_others_go_on() -> None:
    from worker.metric_sinks import Sinks

    good, bad = Recording(), Recording(broken=True)
    warnings: list[str] = []
    sinks = Sinks([("mlflow", bad), ("wandb", good)], warn=warnings.append)
    sinks.log_config({"model": "tiny-llama"})
    sinks.log_steps([{"step": 1, "train_loss": 2.0}])
    sinks.log_steps([{"step": 2, "train_loss": 1.5}])
    sinks.close("succeeded")
    assert warnings == [
        "The mlflow integration stopped logging: tracking server went away; the job trains on"
    ]
    assert bad.calls == [("config", {"model": "tiny-llama"})]
    assert good.calls == [
        ("config", {"model": "tiny-llama"}),
        ("steps", [1]),
        ("steps", [2]),
        ("close", "succeeded"),
    ]
