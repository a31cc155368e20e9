"""A job's `integrations`: experiment trackers its worker logs the job's metrics and config to.

OpenAI's `{"type": "wandb", "wandb": {"project", "name", "entity", "tags"}}`, and Loraq's
`{"type": "mlflow", "mlflow": {"experiment", "run_name"}}`. The request names only where to log;
the credentials and the server are the worker's: `WANDB_API_KEY` (or `WANDB_MODE=offline`) in its
environment, the MLflow tracking server in `LORAQ_MLFLOW_TRACKING_URI` (a request cannot point a
worker at a URL of its choosing). Each worker says in its registry entry which integrations it can
log (`worker.metric_sinks.available_integrations`); a submit whose queue's live workers can log
none of a type it asks for is refused (400 `integration_unavailable`). A worker that finds at run
time it cannot log says so in a warning event and trains on: an integration never fails a job.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, model_validator

from service.errors import InvalidRequestError
from worker.engine.training_config import Strict, Text

IntegrationType = Literal["wandb", "mlflow"]
INTEGRATION_TYPES: tuple[IntegrationType, ...] = ("wandb", "mlflow")
MAX_INTEGRATIONS = 4
Name = Annotated[Text, Field(min_length=1, max_length=128)]
Tag = Annotated[Text, Field(min_length=1, max_length=64)]


class WandbSettings(Strict):
    """OpenAI's W&B settings: the run goes to `project` (under `entity`, else the key's default),
    named `name` (else the job id), with `tags` beside Loraq's own (`loraq/finetune`,
    `loraq/<base model>`, `loraq/<job id>`)."""

    project: Name
    name: Name | None = None
    entity: Name | None = None
    tags: list[Annotated[Text, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, max_length=20
    )


class MlflowSettings(Strict):
    """Loraq's MLflow settings: the experiment (created if missing; default "loraq") and the
    run's name (default the job id). The tracking server is the worker's setting."""

    experiment: Name = "loraq"
    run_name: Name | None = None


class Integration(Strict):
    """One integration, in OpenAI's shape: `type` names the block that holds its settings (one
    class rather than a tagged union, so that a bad field is named `integrations[0].wandb.project`)."""

    # the rule `_settings_of_its_type` checks, in the schema too (clients and fuzzers see it)
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"type": {"const": "wandb"}}},
                    # present and not null: {"type": "wandb", "wandb": null} is refused too
                    "then": {
                        "required": ["wandb"],
                        "properties": {"wandb": {"type": "object"}, "mlflow": {"type": "null"}},
                    },
                },
                {
                    "if": {"properties": {"type": {"const": "mlflow"}}},
                    "then": {"properties": {"wandb": {"type": "null"}}},
                },
            ]
        }
    )

    type: IntegrationType
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> Integration:
        if self.type == "wandb" and self.wandb is None:
            raise ValueError(
                "an integration of type 'wandb' needs its settings in 'wandb' (project at least)"
            )
        if self.type == "mlflow" and self.mlflow is None:
            self.mlflow = MlflowSettings()
        other = "mlflow" if self.type == "wandb" else "wandb"
        if getattr(self, other) is not None:
            raise ValueError(f"an integration of type {self.type!r} takes no {other!r} settings")
        return self


Integrations = Annotated[list[Integration], Field(max_length=MAX_INTEGRATIONS)]
_STORED = TypeAdapter(list[Integration])


def stored(integrations: list[Integration] | None) -> list[dict[str, Any]] | None:
    """The job row's JSON of the validated request's integrations (None: none asked)."""
    return _STORED.dump_python(integrations, mode="json", exclude_none=True) if integrations else None


def of_job(raw: list[dict[str, Any]] | None) -> list[Integration]:
    """A job row's integrations, typed again."""
    return _STORED.validate_python(raw or [])


def check_served(
    integrations: list[Integration] | None,
    *,
    celery_queue: str,
    served: dict[str, set[str]] | None,
) -> None:
    """400 naming `integrations[i].type` when the live workers of the job's queue can log none of
    that type (their registry entries say which they can). Nothing is known (None, or no live
    worker of that queue yet): accepted, and a worker that cannot log says so in an event."""
    if not integrations or served is None or celery_queue not in served:
        return
    can = served[celery_queue]
    for i, integration in enumerate(integrations):
        if integration.type not in can:
            need = (
                "WANDB_API_KEY (or WANDB_MODE=offline) in the worker's environment and the wandb package"
                if integration.type == "wandb"
                else "LORAQ_MLFLOW_TRACKING_URI on the worker and the mlflow-skinny package"
            )
            raise InvalidRequestError(
                f"integrations[{i}]: no worker of queue {celery_queue!r} can log to {integration.type} "
                f"(it needs {need}: the `integrations` extra); they can log to: "
                + (", ".join(sorted(can)) or "none"),
                param=f"integrations[{i}].type",
                code="integration_unavailable",
            )
