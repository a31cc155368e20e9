"""Where a job's step metrics go besides Loraq's database: its integrations (service/integrations.py).

`MetricSink` is the seam. `JobCallbacks.flush` hands the sinks exactly the steps
`jobs.record_metrics` has just stored, as their `metrics` events' data (`event_data`: floats that
are not finite are null): a step an attempt repeats after resuming is not stored again, so it is
not logged again either. The job's configuration goes first (`log_config`), the resolved plan when
the engine has made it, and `close` ends the run with the job's status.

A sink that cannot log (a package missing, no key, a server that refuses) is dropped with one
warning event; the training goes on. Credentials are the worker's: W&B reads WANDB_API_KEY (or
runs with WANDB_MODE=offline), MLflow's server is `LORAQ_MLFLOW_TRACKING_URI`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from service.integrations import Integration, IntegrationType, MlflowSettings, WandbSettings
from service.settings import Settings

log = logging.getLogger("loraq.worker")

Warn = Callable[[str], None]
JOB_ID_TAG = "loraq.job_id"  # the MLflow tag a later attempt finds the job's run by
MLFLOW_BATCH = 1000  # metrics per log_batch request (MLflow's limit)
# The job's status → the MLflow run's; a paused or re-queued job's run stays RUNNING
MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}


class MetricSink(Protocol):
    def log_config(self, config: dict[str, Any]) -> None: ...
    # rows: `metrics` events' data ({"step", "train_loss", "lr", ...; None where not measured})
    def log_steps(self, rows: list[dict[str, Any]]) -> None: ...
    def close(self, status: str) -> None: ...


def available_integrations(settings: Settings) -> list[IntegrationType]:
    """The integrations this worker process can log (its registry entry says so, and the API
    refuses a job whose queue's workers can log none of a type it asks for)."""
    can: list[IntegrationType] = []
    wandb_mode = os.environ.get("WANDB_MODE", "")
    if importlib.util.find_spec("wandb") and (os.environ.get("WANDB_API_KEY") or wandb_mode == "offline"):
        can.append("wandb")
    if importlib.util.find_spec("mlflow") and settings.mlflow_tracking_uri:
        can.append("mlflow")
    return can


def flat(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """("lora.r", 8), ...: nested keys joined by dots, as MLflow's params are flat."""
    for key, value in config.items():
        if isinstance(value, dict):
            yield from flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """A step's measured values (the step number and nulls left out)."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ("step", "total_steps") and isinstance(v, int | float) and not isinstance(v, bool)
    }


class WandbSink:
    """One W&B run per job, its id derived from the job's (a resumed attempt continues it)."""

    def __init__(self, settings: WandbSettings, *, job_id: str, model: str, run_dir: Path) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or job_id,
            tags=[*settings.tags, "loraq/finetune", f"loraq/{model}"[:64], f"loraq/{job_id}"[:64]],
            id=job_id.replace("ftjob-", ""),  # W&B run ids: letters, digits, - and _
            resume="allow",
            dir=str(run_dir),
            reinit="create_new",  # several jobs in one worker process over its life
            settings=wandb.Settings(console="off", silent=True),
        )

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.run.log(numbers(row), step=int(row["step"]))

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status in ("succeeded", "paused", "queued") else 1)


class MlflowSink:
    """One MLflow run per job in the requested experiment, found again by its `loraq.job_id` tag
    on a later attempt."""

    def __init__(self, settings: MlflowSettings, *, job_id: str, model: str, tracking_uri: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)
        name = settings.experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{JOB_ID_TAG}` = '{job_id}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
        else:
            tags = {JOB_ID_TAG: job_id, "loraq.model": model}
            run = self.client.create_run(experiment_id, run_name=settings.run_name or job_id, tags=tags)
            self.run_id = run.info.run_id
        self._params: set[str] = set()

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # params cannot change once logged: a resumed attempt's (equal) values are not sent again
        params = [Param(k, str(v)[:6000]) for k, v in flat(config) if k not in self._params]
        if params:
            self.client.log_batch(self.run_id, params=params)
            self._params.update(p.key for p in params)

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, int(row["step"])) for row in rows for k, v in numbers(row).items()]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MLFLOW_BATCH])

    def close(self, status: str) -> None:
        if status in MLFLOW_STATUS:
            self.client.set_terminated(self.run_id, MLFLOW_STATUS[status])


class Sinks:
    """The sinks of one attempt. A sink that raises is dropped with one warning; never the job."""

    def __init__(self, sinks: list[tuple[str, MetricSink]], warn: Warn) -> None:
        self.sinks = sinks
        self.warn = warn

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log_config(self, config: dict[str, Any]) -> None:
        self._each(lambda sink: sink.log_config(config))

    def log_steps(self, rows: list[dict[str, Any]]) -> None:
        if rows:
            self._each(lambda sink: sink.log_steps(rows))

    def close(self, status: str) -> None:
        self._each(lambda sink: sink.close(status))
        self.sinks = []

    def _each(self, call: Callable[[MetricSink], None]) -> None:
        for name, sink in list(self.sinks):
            try:
                call(sink)
            except Exception as e:
                self.sinks.remove((name, sink))
                log.warning("%s integration failed", name, exc_info=True)
                self.warn(f"The {name} integration stopped logging: {one_line(e)}; the job trains on")


def one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:299] + "…"


def open_sinks(
    integrations: tuple[Integration, ...],
    *,
    job_id: str,
    model: str,
    settings: Settings,
    warn: Warn,
) -> Sinks:
    """A sink for each integration this worker can log; each one it cannot is a warning event."""
    can = available_integrations(settings)
    opened: list[tuple[str, MetricSink]] = []
    for integration in integrations:
        kind = integration.type
        if kind not in can:
            need = "WANDB_API_KEY or WANDB_MODE=offline" if kind == "wandb" else "LORAQ_MLFLOW_TRACKING_URI"
            warn(
                f"This worker cannot log to {kind} (it needs {need} and the `integrations` extra); "
                "the job trains on"
            )
            continue
        try:
            sink: MetricSink
            if integration.wandb is not None:
                run_dir = settings.resolved_data_dir / "wandb" / job_id
                sink = WandbSink(integration.wandb, job_id=job_id, model=model, run_dir=run_dir)
            else:
                assert integration.mlflow is not None and settings.mlflow_tracking_uri is not None
                uri = settings.mlflow_tracking_uri
                sink = MlflowSink(integration.mlflow, job_id=job_id, model=model, tracking_uri=uri)
        except Exception as e:
            log.warning("%s integration could not start", kind, exc_info=True)
            warn(f"The {kind} integration could not start: {one_line(e)}; the job trains on")
            continue
        opened.append((kind, sink))
    return Sinks(opened, warn)
