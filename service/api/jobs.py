"""`/v1/fine_tuning/jobs`: create, list, retrieve, cancel, pause, resume, events, checkpoints, adapter
download."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Annotated, Any, Protocol

import anyio.from_thread
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import FileResponse, Response
from sqlalchemy.orm import Session

from service import dry_run, file_validation, inference, integrations, jobs
from service.api.downloads import download_response
from service.api.last_served import LastServed
from service.api.plain_route import PlainGetRoute
from service.auth import (
    BearerScheme,
    CurrentTenant,
    authenticate_request,
    check_key_rate,
    request_key_digest,
)
from service.db.models import Checkpoint, Job, JobEvent
from service.db.session import SessionDep
from service.errors import InvalidRequestError, is_database_unavailable
from service.queue import enqueue_job, job_queue
from service.schemas import (
    DATABASE_UNAVAILABLE,
    DISK_FULL,
    CheckpointMetrics,
    CheckpointPublic,
    CheckpointsPublic,
    DpoHyperparametersPublic,
    DpoMethodPublic,
    DpoPublic,
    DryRunPublic,
    EventPublic,
    EventsPublic,
    HyperparametersPublic,
    JobCreate,
    JobErrorPublic,
    JobPublic,
    JobsPublic,
    MethodPublic,
    ProgressPublic,
    SupervisedPublic,
    error_response,
    error_responses,
)
from service.settings import get_settings
from service.worker_registry import served_integrations_now, served_queues_now
from worker.engine.catalog import random_weights_warning

router = APIRouter(
    prefix="/v1/fine_tuning/jobs",
    tags=["fine_tuning"],
    responses={**error_responses(400, 401, 404, 409, 429, 500), **DATABASE_UNAVAILABLE},
)

# Distinct job states whose body `job_body` keeps (a few KiB each): every job being polled, and a
# running job's recent states.
JOB_BODY_CACHE_SIZE = 1024

ZIP_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/zip": {}}, "description": "PEFT adapter (zip)"}
}


def job_public(job: Job) -> JobPublic:
    training = jobs.stored_training(job)
    # as requested until the engine planned the run, then what "auto" resolved to
    planned = job.plan["hyperparameters"] if job.plan else training.hyperparameter_block().model_dump()
    hp = HyperparametersPublic(**planned)
    method = training.method
    echoed = (
        DpoMethodPublic(
            dpo=DpoPublic(
                # beta and rpo_alpha need no data: once the run is planned they show what "auto"
                # resolved to
                hyperparameters=DpoHyperparametersPublic(
                    **planned,
                    beta=method.beta_value if job.plan else method.beta,
                    rpo_alpha=method.rpo_alpha_value if job.plan else method.rpo_alpha,
                )
            ),
        )
        if method.type == "dpo"
        else MethodPublic(supervised=SupervisedPublic(hyperparameters=hp))
    )
    options = {**training.options(), "validation_split": training.validation_split or 0.0}
    return JobPublic(
        **options,
        id=job.id,
        created_at=job.created_at,
        finished_at=job.finished_at,
        error=JobErrorPublic(**job.error) if job.error else None,
        fine_tuned_model=job.fine_tuned_model,
        model=job.model,
        organization_id=job.tenant_id,
        status=job.status,
        hyperparameters=hp,
        training_file=job.training_file,
        validation_file=job.validation_file,
        result_files=list(job.result_files or []),
        trained_tokens=job.trained_tokens,
        estimated_finish=job.estimated_finish,
        integrations=integrations.of_job(job.integrations),
        metadata=job.metadata_,
        method=echoed,
        user_provided_suffix=job.suffix,
        queue=job.queue,
        n_gpus=job.n_gpus,
        n_nodes=job.n_nodes,
        worker_id=job.worker_id,
        started_at=job.started_at,
        cancel_requested=bool(job.cancel_requested),
        pause_requested=bool(job.pause_requested),
        waiting_for=job.waiting_for if job.status == "queued" else None,
        warning=random_weights_warning(job.model),
        progress=ProgressPublic(
            step=job.step,
            total_steps=job.total_steps,
            train_loss=job.train_loss,
            tokens_per_s=job.tokens_per_s,
            eta_seconds=job.eta_seconds,
            padding_fraction=job.padding_fraction,
        ),
    )


def event_public(event: JobEvent) -> EventPublic:
    return EventPublic(
        id=event.id,
        created_at=event.created_at,
        level=event.level,
        message=event.message,
        type=event.type,
        data=event.data,
    )


def checkpoint_public(ckpt: Checkpoint, job: Job) -> CheckpointPublic:
    suffix = job.suffix or ""
    return CheckpointPublic(
        id=ckpt.id,
        created_at=ckpt.created_at,
        fine_tuned_model_checkpoint=f"ft:{job.model}:{suffix}:{job.id}:ckpt-step-{ckpt.step}",
        fine_tuning_job_id=job.id,
        metrics=CheckpointMetrics.model_validate(jobs.checkpoint_metrics(ckpt).model_dump()),
        step_number=ckpt.step,
    )


@router.post(
    "",
    response_model=JobPublic | DryRunPublic,
    responses={
        **error_response(
            503,
            "a dry run found no inference worker (code no_inference_worker), or the database is "
            "unavailable (code database_unavailable; Retry-After)",
        ),
        **DISK_FULL,
    },
)
def create_job(
    body: JobCreate,
    tenant: CurrentTenant,
    session: SessionDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobPublic | DryRunPublic:
    if body.dry_run:  # validate and plan on an inference worker; nothing is stored or queued
        request = dry_run.worker_request(session, tenant_id=tenant.id, spec=body)
        done = anyio.from_thread.run(inference.call, get_settings(), request)
        return dry_run.plan(body, request, done, get_settings())
    if idempotency_key is not None and (
        seen := jobs.replay(
            session, tenant_id=tenant.id, key=idempotency_key, request_sha256=jobs.request_digest(body)
        )
    ):
        return job_public(seen)  # a retried request: the same job, not enqueued again
    job = jobs.create_job(
        session,
        tenant_id=tenant.id,
        spec=body,
        idempotency_key=idempotency_key,
        served_queues=served_queues_now(),
        served_integrations=served_integrations_now(),
    )
    session.commit()
    # after commit: a worker must find the job queued in the database; routed by job.queue/n_gpus
    if job.status == "queued":
        enqueue_job(job.id, queue=job_queue(job))
    elif job.status == "validating_files":  # its files take longer to count than a submit waits
        file_validation.start(job.id)
    return job_public(job)


NO_NUL = r"^[^\u0000]*$"
# OpenAI's `metadata[k]=v` filter: a query parameter per key (the openai client's `metadata=`)
METADATA_FILTER = {
    "name": "metadata",
    "in": "query",
    "required": False,
    "style": "deepObject",
    "explode": True,
    # no NUL in a key or value (refused with 400 invalid_query: PostgreSQL's text cannot hold it)
    "schema": {
        "type": "object",
        "propertyNames": {"pattern": NO_NUL},
        "additionalProperties": {"type": "string", "pattern": NO_NUL},
    },
    "description": "metadata[k]=v: only jobs whose metadata has every given pair",
}


def metadata_filter(request: Request) -> dict[str, str]:
    """The `metadata[k]=v` pairs of the request's query."""
    found: dict[str, str] = {}
    for name, value in request.query_params.multi_items():
        if name.startswith("metadata[") and name.endswith("]"):
            if "\x00" in name or "\x00" in value:  # PostgreSQL's text holds no NUL: nothing to match
                raise InvalidRequestError("a metadata filter may not contain NUL characters", param=name)
            found[name[len("metadata[") : -1]] = value
    return found


@router.get("", response_model=JobsPublic, openapi_extra={"parameters": [METADATA_FILTER]})
def list_jobs(
    request: Request,
    tenant: CurrentTenant,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JobsPublic:
    rows, has_more = jobs.list_jobs(
        session, tenant_id=tenant.id, after=after, limit=limit, metadata=metadata_filter(request)
    )
    return JobsPublic(data=[job_public(j) for j in rows], has_more=has_more)


@router.get("/{fine_tuning_job_id}", response_model=JobPublic)
async def retrieve_job(fine_tuning_job_id: str, request: Request, _: BearerScheme) -> Response:
    # Documents the operation; its GETs are served by `status_read_route` (the same function).
    return await read_job_status(request)


# The body each key was last served for each job: answered again, marked stale, while the
# database is unreachable (service/api/last_served.py says why that is sound).
last_served = LastServed()


async def read_job_status(request: Request) -> Response:
    """The status-polling hot path: the key and the job in one read on a bare connection (no
    session, no commit), then the rate limit; the body from `job_body`."""
    job_id = request.path_params["fine_tuning_job_id"]
    digest = request_key_digest(request)
    try:
        _tenant, row = await authenticate_request(
            request, jobs.KEY_AND_JOB, jobs.key_and_job_params(job_id), digest=digest
        )
    except Exception as exc:
        stale = last_served.stale_response(digest, job_id) if is_database_unavailable(exc) else None
        if stale is None:
            raise  # 503 (service/errors.py), or whatever else it is
        await check_key_rate(digest)
        return stale
    body = job_body(jobs.job_values(row, job_id))
    last_served.remember(digest, job_id, body)
    return Response(body, media_type="application/json")


@lru_cache(maxsize=JOB_BODY_CACHE_SIZE)
def job_body(values: tuple[Any, ...]) -> bytes:
    """The job object's JSON for `jobs.job_values`. Cached under those values, every column of
    the job as read: a job that changed in any way is another key, so a cached body is never
    stale, and a job polled many times between two changes is serialised once (building and
    dumping the JobPublic took about 50 µs a read)."""
    return job_public(jobs.job_of_values(values)).model_dump_json().encode()


status_read_route = PlainGetRoute(router.prefix + "/{fine_tuning_job_id}", read_job_status)


class JobRequest(Protocol):
    """A state change a user asks for (`jobs.request_cancel`, `request_pause`, `request_resume`)."""

    def __call__(self, session: Session, *, tenant_id: str, job_id: str) -> Job: ...


def job_action_route(action: str, refused: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`POST /{fine_tuning_job_id}/<action>`, answered with the job; `refused`: when its 400 comes."""
    return router.post(
        f"/{{fine_tuning_job_id}}/{action}",
        response_model=JobPublic,
        responses={**error_response(400, f"{refused} (code invalid_job_state)"), **DISK_FULL},
    )


def job_action(
    request: JobRequest, *, job_id: str, tenant_id: str, session: Session, enqueue: bool = False
) -> JobPublic:
    """`request` committed; with `enqueue`, a job it left queued is sent to its queue after the
    commit, as a submit's is."""
    job = request(session, tenant_id=tenant_id, job_id=job_id)
    session.commit()
    if enqueue and job.status == "queued":
        enqueue_job(job.id, queue=job_queue(job))
    return job_public(job)


@job_action_route("cancel", "the job already succeeded or failed")
def cancel_job(fine_tuning_job_id: str, tenant: CurrentTenant, session: SessionDep) -> JobPublic:
    return job_action(jobs.request_cancel, job_id=fine_tuning_job_id, tenant_id=tenant.id, session=session)


@job_action_route("pause", "the job is not queued, running or paused, or has a cancel requested")
def pause_job(fine_tuning_job_id: str, tenant: CurrentTenant, session: SessionDep) -> JobPublic:
    return job_action(jobs.request_pause, job_id=fine_tuning_job_id, tenant_id=tenant.id, session=session)


@job_action_route("resume", "the job is not paused")
def resume_job(fine_tuning_job_id: str, tenant: CurrentTenant, session: SessionDep) -> JobPublic:
    return job_action(
        jobs.request_resume, job_id=fine_tuning_job_id, tenant_id=tenant.id, session=session, enqueue=True
    )


@router.get("/{fine_tuning_job_id}/events", response_model=EventsPublic)
def list_events(
    fine_tuning_job_id: str,
    tenant: CurrentTenant,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 20,
) -> EventsPublic:
    rows, has_more = jobs.list_events(
        session, tenant_id=tenant.id, job_id=fine_tuning_job_id, after=after, limit=limit
    )
    return EventsPublic(data=[event_public(e) for e in rows], has_more=has_more)


@router.get("/{fine_tuning_job_id}/checkpoints", response_model=CheckpointsPublic)
def list_checkpoints(
    fine_tuning_job_id: str,
    tenant: CurrentTenant,
    session: SessionDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
) -> CheckpointsPublic:
    job = jobs.get_job(session, tenant_id=tenant.id, job_id=fine_tuning_job_id)
    rows, has_more = jobs.list_checkpoints(
        session, tenant_id=tenant.id, job_id=fine_tuning_job_id, after=after, limit=limit
    )
    data = [checkpoint_public(c, job) for c in rows]
    return CheckpointsPublic(
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{fine_tuning_job_id}/adapter", response_class=FileResponse, responses=ZIP_RESPONSE)
def download_adapter(fine_tuning_job_id: str, tenant: CurrentTenant, session: SessionDep) -> Response:
    artifact = jobs.get_adapter(session, tenant_id=tenant.id, job_id=fine_tuning_job_id)
    return download_response(
        artifact.storage_key,
        artifact.sha256,
        media_type="application/zip",
        filename=f"{fine_tuning_job_id}-adapter.zip",
        size=artifact.bytes,
    )


@router.get(
    "/{fine_tuning_job_id}/checkpoints/{checkpoint_id}/adapter",
    response_class=FileResponse,
    responses=ZIP_RESPONSE,
)
def download_checkpoint_adapter(
    fine_tuning_job_id: str, checkpoint_id: str, tenant: CurrentTenant, session: SessionDep
) -> Response:
    ckpt = jobs.get_checkpoint(
        session, tenant_id=tenant.id, job_id=fine_tuning_job_id, checkpoint_id=checkpoint_id
    )
    return download_response(
        ckpt.storage_key, ckpt.sha256, media_type="application/zip", filename=f"{checkpoint_id}.zip"
    )
