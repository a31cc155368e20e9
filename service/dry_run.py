"""`POST /v1/fine_tuning/jobs` with `"dry_run": true`: what the job would do, without queueing it.

The API checks what it can itself (model, files, hyperparameters: the same checks as a real
submit); tokenizing the files needs the model's tokenizer, which only workers load, so an
inference worker reads and tokenizes them exactly as the job would (worker/inference.py): the
same validation holdout (`validation_split` of the examples when there is no validation file,
drawn with the job's seed), the same plan ("auto" resolved from the tokenized examples by
`plan_auto`) and the same rows (packed or one example a row), by the engine's own
`planned_datasets`. From those counts and that plan this module counts the run with the engine's
own arithmetic: optimizer steps by `plan_steps` (grad_accum micro-batches a step), and

    trained tokens = n_epochs · tokens of the trained examples     (padding is never counted)

and adds the estimates of service/estimates.py. Invalid lines come back as `errors` (200, with
`valid: false`), so a client sees every problem of the file at once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from service import estimates, inference, jobs, memory_check, worker_registry
from service.schemas import (
    DatasetSummary,
    DryRunError,
    DryRunPublic,
    EstimatePublic,
    HyperparametersPublic,
    JobCreate,
    MemoryPlanPublic,
    TrainingData,
)
from service.settings import Settings
from worker.engine.catalog import model_shape
from worker.engine.holdout import holdout_sentence
from worker.engine.training_config import global_batch, plan_steps


def worker_request(session: Session, *, tenant_id: str, spec: JobCreate) -> dict[str, Any]:
    """Validate like a submit does (404/400 raised here), except that a file which failed
    validation goes on to the worker, whose report lists its bad lines in the plan. The seed is
    drawn here when the request has none (as a submit draws it), and the plan reports it."""
    training, validation = jobs.check_job_inputs(
        session, tenant_id=tenant_id, spec=spec, refuse_invalid=False
    )
    requested = jobs.requested_training(spec)  # refuses hyperparameters given twice
    # a file in another format than the method's is refused as a submit refuses it
    jobs.check_file_format(training, requested.method, "training_file")
    if validation is not None:
        jobs.check_file_format(validation, requested.method, "validation_file")
    return {
        "kind": "dry_run",
        "id": inference.new_request_id(),
        "base": spec.model,
        "training_file": training.storage_key,
        "validation_file": validation.storage_key if validation is not None else None,
        "max_seq_len": spec.max_seq_len,
        "training": requested.model_dump(mode="json"),  # the worker plans "auto" as the job will
        "n_gpus": spec.n_gpus * spec.n_nodes,  # the ranks the worker plans "auto" for
        "validation_split": jobs.validation_split(spec),
        "seed": jobs.job_seed(spec),
    }


def _summary(report: dict[str, Any]) -> DatasetSummary:
    return DatasetSummary(**{k: report[k] for k in DatasetSummary.model_fields})


def _errors(param: str, report: dict[str, Any] | None) -> list[DryRunError]:
    if report is None:
        return []
    return [DryRunError(param=param, line=e["line"] or None, message=e["reason"]) for e in report["errors"]]


def _step_limit_error(steps: int, settings: Settings) -> list[DryRunError]:
    if steps <= settings.job_max_steps:
        return []
    return [
        DryRunError(
            param="hyperparameters",
            message=f"the run needs {steps} optimizer steps, over this service's limit of "
            f"{settings.job_max_steps} (fewer epochs or a larger batch_size)",
        )
    ]


def plan(spec: JobCreate, request: dict[str, Any], done: dict[str, Any], settings: Settings) -> DryRunPublic:
    """The plan of `request` (from `worker_request`) from the worker's counts `done`."""
    requested = jobs.requested_training(spec)
    training_file, validation_file = done["training_file"], done.get("validation_file")
    trained = TrainingData(**{k: done["training"][k] for k in TrainingData.model_fields})
    planned = done["training"]["plan"]  # None when the file has no valid example
    hp = planned["hyperparameters"] if planned else requested.hyperparameter_block().model_dump()
    n_epochs = int(hp["n_epochs"]) if hp["n_epochs"] != "auto" else 0
    batch_size = int(hp["batch_size"]) if hp["batch_size"] != "auto" else 1
    # the engine's ranks (n_gpus on each of n_nodes hosts): per_gpu gives each batch_size rows
    world = spec.n_gpus * spec.n_nodes
    rows_a_step = global_batch(batch_size, world, spec.batch_scaling)
    steps = plan_steps(trained.rows, batch_size=rows_a_step, n_epochs=n_epochs, grad_accum=spec.grad_accum)
    errors = (
        _errors("training_file", training_file)
        + _errors("validation_file", validation_file)
        + _step_limit_error(steps.steps, settings)
    )
    trained_tokens = n_epochs * trained.tokens
    row_tokens = planned["row_tokens"] if planned else spec.max_seq_len
    # what the worker plans: one GPU's rows of the micro-batch, of row_tokens each
    rows = memory_check.gpu_rows(batch_size, spec)
    step = memory_check.spec_step(spec, rows=rows, seq=row_tokens)
    found = estimates.estimates(
        spec.model,
        trained_tokens=trained_tokens,
        queue=spec.queue or settings.worker_queue,
        step=step,
        shape=model_shape(spec.model, settings.model_store),  # a model of no row: scaled from one
    )
    return DryRunPublic(
        model=spec.model,
        valid=not errors,
        training_file=_summary(training_file),
        validation_file=_summary(validation_file) if validation_file else None,
        hyperparameters=HyperparametersPublic(**hp),
        row_tokens=planned["row_tokens"] if planned else spec.max_seq_len,
        plan=planned["message"] if planned else "nothing to plan: the file has no valid example",
        max_seq_len=spec.max_seq_len,
        packing=spec.packing,
        seed=int(request["seed"]),
        validation_split=float(request["validation_split"]),
        validation=holdout_sentence(
            examples=trained.examples + trained.held_out_examples,
            fraction=float(request["validation_split"]),
            validation_file=spec.validation_file,
        ),
        training=trained,
        batch_scaling=spec.batch_scaling,
        global_batch_size=rows_a_step,
        learning_rate=planned["learning_rate"] if planned else None,
        grad_accum=spec.grad_accum,
        micro_batches_per_epoch=steps.micro_batches_per_epoch,
        steps=steps.steps,
        trained_tokens=trained_tokens,
        estimates=[EstimatePublic(**vars(e)) for e in found],
        memory=_memory(spec, batch_size, row_tokens, settings),
        errors=errors,
    )


def _memory(spec: JobCreate, batch_size: int, row_tokens: int, settings: Settings) -> list[MemoryPlanPublic]:
    """The plan of a micro-batch of this job's rows on each GPU size of its queue's live workers."""
    workers = worker_registry.live_workers_now()
    if workers is None:
        return []
    from service.broker import celery_queue

    queue = celery_queue(spec.queue or settings.worker_queue, spec.n_gpus)
    rows = memory_check.gpu_rows(batch_size, spec)
    found = memory_check.plans(spec, memory_check.queue_gpu_bytes(workers, queue), rows=rows, seq=row_tokens)
    return [MemoryPlanPublic(**p) for p in memory_check.public(found)]
