"""The web dashboard: pages at `/`, `/jobs/{id}`, `/new`, `/workers`, `/compare?ids=…`, assets under
`/static`, and the few JSON endpoints the REST API (`/v1`) lacks, under `/dashboard/api`.

Pages and assets are public (they hold no data); every data request carries the same Bearer key
as the REST API, entered once in the browser and kept in its localStorage. Everything, the
charting library included (uPlot, `static/vendor/uplot`), is served from here: no CDN.

Dashboard-only endpoints (same auth as /v1, the tenant's rows only):
- `GET /dashboard/api/jobs?status=&limit=`        jobs with their progress (step, loss, tokens/s, ETA)
- `GET /dashboard/api/jobs/{id}/progress`         the same for one job
- `GET /dashboard/api/jobs/{id}/metrics?after=`   per-step rows after step `after`, for the charts
- `GET /dashboard/api/jobs/{id}/samples`          eval_prompts and their greedy answers per checkpoint
- `GET /dashboard/api/jobs/{id}/metrics.csv`       every step so far as OpenAI's results CSV (any status)
- `GET /dashboard/api/jobs/{id}/webhook_deliveries` its webhook deliveries and their attempts
- `GET /dashboard/api/files/{id}/summary`         structural check of an uploaded JSONL file
- `GET /dashboard/api/workers`                    the worker registry (Redis): GPUs, job, kernels;
                                                  then the inference workers (their heartbeats)
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError

from service import files, inference, webhooks, worker_registry
from service import jobs as job_service
from service.api.webhooks import delivery_public
from service.auth import CurrentTenant
from service.dashboard_schemas import (
    CheckpointSamplesPublic,
    FileSummaryPublic,
    HealthWarningPublic,
    JobProgressListPublic,
    JobProgressPublic,
    SamplesPublic,
    StepRowsPublic,
    WorkerJobPublic,
    WorkerPublic,
    WorkersPublic,
)
from service.db.models import Job
from service.db.session import SessionDep
from service.errors import NotFoundError, UnavailableError
from service.job_status import JobStatus
from service.schemas import error_responses
from service.step_metrics import metrics_csv
from service.webhook_schemas import WebhookDeliveriesPublic
from worker.engine.holdout import holdout_sentence

log = logging.getLogger("loraq.dashboard")

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
PAGES_DIR = STATIC_DIR / "dashboard"
MAX_METRIC_ROWS = 100_000
MAX_WEBHOOK_DELIVERIES = 100
MAX_STEP = 2**31 - 1  # steps are INTEGER columns: PostgreSQL's int4 ends here


PAGES = {  # page name -> (title, body fragment, script)
    "jobs": ("Jobs", "jobs.html", "jobs.js"),
    "job": ("Job", "job.html", "job.js"),
    "new": ("New job", "new.html", "new.js"),
    "workers": ("Workers", "workers.html", "workers.js"),
    "compare": ("Compare runs", "compare.html", "compare.js"),
}

pages = APIRouter(include_in_schema=False)
api = APIRouter(
    prefix="/dashboard/api", tags=["dashboard"], responses=error_responses(400, 401, 404, 429, 503)
)

# The pages load only same-origin scripts and styles (no inline script or style attribute), may not
# be framed, and send no referrer to other origins: an injected string cannot run as script.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


@lru_cache
def render_page(name: str) -> str:
    """The layout with the page's body and script filled in (read once per process)."""
    title, body, script = PAGES[name]
    layout = (PAGES_DIR / "layout.html").read_text()
    return (
        layout.replace("{{title}}", title)
        .replace("{{body}}", (PAGES_DIR / body).read_text())
        .replace("{{script}}", script)
    )


def page(name: str) -> HTMLResponse:
    return HTMLResponse(render_page(name), headers=PAGE_HEADERS)


@pages.get("/", response_class=HTMLResponse)
def jobs_page() -> HTMLResponse:
    return page("jobs")


@pages.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str) -> HTMLResponse:
    return page("job")  # the page reads the id from its URL


@pages.get("/new", response_class=HTMLResponse)
def new_job_page() -> HTMLResponse:
    return page("new")


@pages.get("/compare", response_class=HTMLResponse)
def compare_page() -> HTMLResponse:
    return page("compare")  # the page reads the job ids from its query string


@pages.get("/workers", response_class=HTMLResponse)
def workers_page() -> HTMLResponse:
    return page("workers")


def progress(job: Job, warnings: list[dict[str, Any]]) -> JobProgressPublic:
    return JobProgressPublic(
        id=job.id,
        status=job.status,
        model=job.model,
        suffix=job.suffix,
        error_code=(job.error or {}).get("code"),
        warnings=[HealthWarningPublic(**w) for w in warnings],
        result_files=list(job.result_files or []),
        fine_tuned_model=job.fine_tuned_model,
        step=job.step,
        total_steps=job.total_steps,
        train_loss=job.train_loss,
        tokens_per_s=job.tokens_per_s,
        padding_fraction=job.padding_fraction,
        eta_seconds=job.eta_seconds,
        trained_tokens=job.trained_tokens,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
    )


def tenant_job(session: SessionDep, tenant_id: str, job_id: str) -> Job:
    return job_service.get_job(session, tenant_id=tenant_id, job_id=job_id, param="job_id")


@api.get("/jobs", response_model=JobProgressListPublic)
def list_jobs(
    tenant: CurrentTenant,
    session: SessionDep,
    status: Annotated[JobStatus | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> JobProgressListPublic:
    jobs, _ = job_service.list_jobs(session, tenant_id=tenant.id, after=None, limit=limit, status=status)
    warnings = job_service.health_warnings(session, job_ids=[j.id for j in jobs])
    return JobProgressListPublic(data=[progress(j, warnings[j.id]) for j in jobs])


@api.get("/jobs/{job_id}/progress", response_model=JobProgressPublic)
def job_progress(job_id: str, tenant: CurrentTenant, session: SessionDep) -> JobProgressPublic:
    job = tenant_job(session, tenant.id, job_id)
    found = progress(job, job_service.health_warnings(session, job_ids=[job.id])[job.id])
    found.validation = validation(session, job)
    return found


def validation(session: SessionDep, job: Job) -> str:
    """What the job validates on, in the words of its own event (`holdout_sentence`), with the
    training file's examples as its upload check counted them (the rule alone once the file is
    deleted)."""
    fraction = job_service.stored_training(job).validation_split or 0.0
    examples = None
    if job.validation_file is None and fraction > 0:
        try:
            file = files.get_file(session, tenant_id=job.tenant_id, file_id=job.training_file)
            examples = files.stored_summary(session, file)["examples"]
        except (NotFoundError, OSError):
            examples = None
    return holdout_sentence(examples=examples, fraction=fraction, validation_file=job.validation_file)


@api.get("/jobs/{job_id}/webhook_deliveries", response_model=WebhookDeliveriesPublic)
def job_webhook_deliveries(
    job_id: str, tenant: CurrentTenant, session: SessionDep
) -> WebhookDeliveriesPublic:
    """The job's events sent to the tenant's webhook endpoints, newest first, with each attempt."""
    tenant_job(session, tenant.id, job_id)
    rows = webhooks.deliveries(session, tenant_id=tenant.id, job_id=job_id, limit=MAX_WEBHOOK_DELIVERIES)
    return WebhookDeliveriesPublic(data=[delivery_public(*row) for row in rows])


@api.get(
    "/jobs/{job_id}/metrics.csv",
    response_class=Response,
    responses={200: {"content": {"text/csv": {}}, "description": "per-step metrics, OpenAI's columns"}},
)
def job_metrics_csv(job_id: str, tenant: CurrentTenant, session: SessionDep) -> Response:
    """The results CSV of every step so far: for a running, failed or cancelled job too."""
    tenant_job(session, tenant.id, job_id)
    body = metrics_csv(job_service.metric_rows(session, job_id=job_id))
    headers = {"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'}
    return Response(body, media_type="text/csv", headers=headers)


@api.get("/jobs/{job_id}/metrics", response_model=StepRowsPublic)
def job_metrics(
    job_id: str,
    tenant: CurrentTenant,
    session: SessionDep,
    after: Annotated[int, Query(ge=0, le=MAX_STEP, description="return steps greater than this")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_METRIC_ROWS)] = MAX_METRIC_ROWS,
) -> StepRowsPublic:
    tenant_job(session, tenant.id, job_id)
    return StepRowsPublic(data=job_service.metric_rows(session, job_id=job_id, after=after, limit=limit))


@api.get("/jobs/{job_id}/samples", response_model=SamplesPublic)
def job_samples(job_id: str, tenant: CurrentTenant, session: SessionDep) -> SamplesPublic:
    """The job's eval_prompts and, per checkpoint (by step), the greedy answer to each."""
    job = tenant_job(session, tenant.id, job_id)
    checkpoints = job_service.checkpoints_by_step(session, job_id=job.id)
    stored = [job_service.checkpoint_metrics(c) for c in checkpoints]
    data = [CheckpointSamplesPublic(step=m.step, samples=m.samples) for m in stored if m.samples]
    return SamplesPublic(prompts=job.eval_prompts or [], data=data)


@api.get("/files/{file_id}/summary", response_model=FileSummaryPublic)
def file_summary(file_id: str, tenant: CurrentTenant, session: SessionDep) -> FileSummaryPublic:
    file = files.get_file(session, tenant_id=tenant.id, file_id=file_id)
    return FileSummaryPublic(file_id=file.id, filename=file.filename, **files.stored_summary(session, file))


def registry_client() -> redis.Redis:
    return worker_registry.default_client()


@api.get("/workers", response_model=WorkersPublic, response_model_exclude_unset=True)
def list_workers(tenant: CurrentTenant, session: SessionDep) -> WorkersPublic:
    """Every worker (they are shared), training workers first, then inference workers; the job a
    worker runs is named only to its own tenant. An entry's fields are those its worker wrote
    (unset ones are left out, not null)."""
    try:
        client = registry_client()
        entries = worker_registry.list_workers(client)
        serving = inference.live_inference_workers(client)
    except redis.exceptions.RedisError as e:
        raise UnavailableError(f"the worker registry (Redis) is unreachable: {e}") from e
    workers = [w for w in map(_worker_or_none, entries) if w is not None]
    workers += [_inference_worker(w) for w in serving]
    busy = [w.job.job_id for w in workers if w.job is not None and w.job.job_id is not None]
    own = job_service.own_job_ids(session, tenant_id=tenant.id, job_ids=busy)
    for w in workers:
        if w.job is not None and w.job.job_id not in own:
            w.job = WorkerJobPublic(job_id=None, other_tenant=True)
    return WorkersPublic(object="list", data=workers)  # set: exclude_unset would drop a default


def _worker_or_none(entry: Any) -> WorkerPublic | None:
    """One registry entry; a malformed one (a worker of another version) is logged and left out,
    so one bad entry does not take the Workers page down."""
    try:
        return WorkerPublic.model_validate({"kind": "training", **entry})
    except ValidationError as e:
        log.warning("worker registry entry left out: %s", e.errors(include_url=False)[:3])
        return None


def _inference_worker(seen: inference.InferenceWorkerSeen) -> WorkerPublic:
    """An inference worker as a row of the Workers page: its id is "host:pid"."""
    host, _, pid = seen.worker_id.rpartition(":")
    fields: dict[str, Any] = {"hostname": host, "pid": int(pid)} if host and pid.isdigit() else {}
    return WorkerPublic(
        node=seen.worker_id, kind="inference", queue=seen.queue, last_seen=seen.last_seen, **fields
    )


def mount_dashboard(app: FastAPI) -> None:
    """Pages, static assets and the dashboard's JSON endpoints, on `app`."""
    app.include_router(api)
    app.include_router(pages)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
