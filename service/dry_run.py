"""`POST /v1/fine_tuning/jobs` with `"dry_run": true`: what the job would do, without queueing it.

The API checks what it can itself (model, files, hyperparameters: the same checks as a real
submit); tokenizing the files needs the model's tokenizer, which only workers load, so an
inference worker reads and tokenizes them exactly as the job would (worker/inference.py) and
returns the counts, with the training rows the job will form (packed several examples a row
unless `packing` is off, one example a row otherwise). From those this module plans the run as
the engine will: "auto" resolved by the function a worker's claim uses (`resolve_auto`), and

    steps per epoch = ceil(rows / batch_size)      steps = n_epochs · steps per epoch
    trained tokens  = n_epochs · tokens            (padding is never counted)

and adds the estimates of service/estimates.py. Invalid lines come back as `errors` (200, with
`valid: false`), so a client sees every problem of the file at once.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy.orm import Session

from service import estimates, inference, jobs
from service.schemas import (
    DatasetSummary,
    DryRunError,
    DryRunPublic,
    EstimatePublic,
    HyperparametersPublic,
    JobCreate,
)
from service.settings import Settings
from worker.engine.training_config import resolve_auto


def worker_request(session: Session, *, tenant_id: str, spec: JobCreate) -> dict[str, Any]:
    """Validate like a submit does (404/400 raised here), except that a file which failed
    validation goes on to the worker, whose report lists its bad lines in the plan."""
    training, validation = jobs.check_job_inputs(
        session, tenant_id=tenant_id, spec=spec, refuse_invalid=False
    )
    jobs.requested_training(spec)  # refuses hyperparameters given twice
    return {
        "kind": "dry_run",
        "id": inference.new_request_id(),
        "base": spec.model,
        "training_file": training.storage_key,
        "validation_file": validation.storage_key if validation is not None else None,
        "max_seq_len": spec.max_seq_len,
        "packing": spec.packing,
    }


def _summary(report: dict[str, Any]) -> DatasetSummary:
    return DatasetSummary(**{k: report[k] for k in DatasetSummary.model_fields})


def _errors(param: str, report: dict[str, Any] | None) -> list[DryRunError]:
    if report is None:
        return []
    return [DryRunError(param=param, line=e["line"] or None, message=e["reason"]) for e in report["errors"]]


def plan(spec: JobCreate, done: dict[str, Any], settings: Settings) -> DryRunPublic:
    resolved = resolve_auto(jobs.requested_training(spec))
    training, validation = done["training_file"], done.get("validation_file")
    n_epochs, batch_size = int(resolved.n_epochs), int(resolved.batch_size)
    steps_per_epoch = math.ceil(training["rows"] / batch_size)
    steps = n_epochs * steps_per_epoch
    errors = _errors("training_file", training) + _errors("validation_file", validation)
    if steps > settings.job_max_steps:
        errors.append(
            DryRunError(
                param="hyperparameters",
                message=f"the run needs {steps} optimizer steps, over this service's limit of "
                f"{settings.job_max_steps} (fewer epochs or a larger batch_size)",
            )
        )
    trained_tokens = n_epochs * int(training["tokens"])
    found = estimates.estimates(
        spec.model,
        trained_tokens=trained_tokens,
        batch_size=batch_size,
        longest_row=training["longest_row"],
    )
    return DryRunPublic(
        model=spec.model,
        valid=not errors,
        training_file=_summary(training),
        validation_file=_summary(validation) if validation else None,
        hyperparameters=HyperparametersPublic(**resolved.hyperparameter_block().model_dump()),
        max_seq_len=spec.max_seq_len,
        packing=spec.packing,
        steps_per_epoch=steps_per_epoch,
        steps=steps,
        trained_tokens=trained_tokens,
        estimates=[EstimatePublic(**vars(e)) for e in found],
        errors=errors,
    )
