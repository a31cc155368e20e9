"""The job state machine. The database is the source of truth; Redis only carries wake-ups.

    validating_files ─► queued ─► running ─► succeeded | failed | cancelled
                          │          ▲  │
                          │          └──┘ requeue (a silent worker's job goes back; `fail_stale`
                          │                once its attempts are used up; `cancel_stale` ends it
                          │                `cancelled` if a cancel was requested)
                          └─► cancelled   (and `failed` at claim time if its dataset file vanished)

A pause (`request_pause`) moves a queued job to `paused` at once and asks a running one to stop:
its worker stops at the next step with a checkpoint and ends the attempt `paused` (`pause`),
freeing the GPU; `request_resume` puts it back to `queued`, and the next claim resumes from
that checkpoint. A paused job can be cancelled; its attempts that ended in a pause are not
retries (`paused_attempts`).

A job whose files take longer to count than a submit waits stays in `validating_files` until they
are counted, then goes to `queued`, or to `failed` with the error a submit answers for them
(service/file_validation.py); a cancel ends it `cancelled` there too.

Every transition is one conditional UPDATE guarded by the expected status and, for a worker's
writes, the attempt token its claim received:

    UPDATE jobs SET ... WHERE id = :id AND status = :expected [AND attempt_token = :token]

and its rowcount says whether it happened. A duplicate delivery finds the job no longer
`queued` and gets no claim; a worker whose attempt was superseded (re-queued after it went
silent) finds its token gone and every write is refused (`StaleAttemptError` or `False`).

A worker's delivery is a wake-up for its queue, not an order to run that one job (`claim_next`):
it claims the next job of that queue round-robin across the tenants with queued jobs (a tenant's
own jobs stay FIFO), skipping tenants at their running-job limit; a job that must wait says why
in `waiting_for` and in an event.
"""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Row, Update, bindparam, func, insert, select, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from service import integrations, memory_check, webhooks, worker_registry
from service.auth import KEY_QUERY
from service.db.models import Artifact, Checkpoint, File, Job, JobEvent, JobMetric, Tenant, is_id, now_s
from service.db.session import decode_json_and_bools
from service.errors import ConflictError, InvalidRequestError, NotFoundError, RateLimitError
from service.integrations import Integration
from service.job_status import ACTIVE, PAUSED, TERMINAL
from service.schemas import JobCreate, StoredCheckpointMetrics
from service.settings import get_settings
from service.step_metrics import StepRow, event_data
from worker.engine.catalog import random_weights_warning
from worker.engine.dataset_rules import PREFERENCE_FORMAT
from worker.engine.training_config import (
    MAX_SEED,
    METHOD_TYPES,
    DpoTraining,
    Hyperparameters,
    SupervisedTraining,
    TrainingConfig,
    TrainingMethod,
)
from worker.engine.types import ModelError, StepMetrics

# The training fields (worker/engine/training_config.py) with a column of their own in the job
# row; the others are kept in its `hyperparameters` JSON beside OpenAI's three.
TRAINING_COLUMNS = ("lora", "max_seq_len", "packing", "seed", "eval_prompts")
# Events of this type hold what only the operator may read (a worker's traceback): the API never
# lists them; `loraq jobs internal-errors JOB` (database access) prints them.
OPERATOR_EVENT = "internal"
MAX_CLAIM_TRIES = 5  # candidates a delivery tries when other workers win the race for them
MAX_SEQ_LEN_TOO_SHORT = "max_seq_len_too_short"  # the code of a file's examples over max_seq_len


class StaleAttemptError(ConflictError):
    """A worker wrote with an attempt token that is no longer the job's (or the job ended)."""

    code = "stale_attempt"


@dataclass(frozen=True)
class Claim:
    """What a worker holds while it runs one attempt of a job."""

    job_id: str
    tenant_id: str
    attempt: int
    attempt_token: str
    worker_id: str
    model: str
    training_file: str  # storage key of the training JSONL
    validation_file: str | None  # storage key, or None
    training: TrainingConfig  # as requested ("auto" kept); seed and validation_split set at submit
    suffix: str | None
    resume_checkpoint: str | None  # storage key of the latest registered checkpoint zip
    n_gpus: int = 1  # > 1: the worker runs the engine under torchrun
    n_nodes: int = 1  # > 1: this attempt runs on that many workers at once (`join`)
    resume_step: int = 0  # the step of `resume_checkpoint` (0: none, the run starts from step 0)
    paused_attempts: int = 0  # earlier attempts that ended in a pause (not counted as retries)
    integrations: tuple[Integration, ...] = ()  # where the worker logs the job


# ---------------------------------------------------------------- reads


# Built once: status polling reads a job by id many times a second.
_JOB_OF_TENANT = select(Job).where(Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id"))


# The same job as read-only columns labelled with the ORM attribute names (`metadata_`, ...):
# status polling loads no ORM object; it builds one (`job_of_values`) only for a job whose
# values it has not serialised yet (service/api/jobs.py, `job_body`).
_JOB_COLUMNS = [attr.columns[0].label(attr.key) for attr in sa_inspect(Job).column_attrs]
_JOB_KEYS = [column.name for column in _JOB_COLUMNS]

# Status polling reads the request's API key and the job in one statement, one round trip instead
# of two (on PostgreSQL about 60 µs of API CPU and 20 µs of server CPU less a read): the key's
# columns first (`auth.tenant_of_key_row`), then the job's, NULL where the key's tenant has no
# job `job_id` (also another tenant's job: existence is not revealed).
KEY_AND_JOB = KEY_QUERY.add_columns(*_JOB_COLUMNS).outerjoin(
    Job, (Job.tenant_id == Tenant.id) & (Job.id == bindparam("job_id"))
)
_KEY_COLUMNS = len(KEY_QUERY.selected_columns)


def key_and_job_params(job_id: str) -> dict[str, Any]:
    """`KEY_AND_JOB`'s job parameter: None (no row) for what is not an id, which PostgreSQL's
    text could not even hold (a NUL byte)."""
    return {"job_id": job_id if is_id(job_id) else None}


def job_values(row: Any, job_id: str) -> tuple[Any, ...]:
    """The job's columns of an authenticated `KEY_AND_JOB` row as `read_first` returns them
    (hashable driver values, every column of the job), or 404."""
    if row.id is None:
        raise NotFoundError(f"No fine-tuning job found with id {job_id!r}", param="fine_tuning_job_id")
    return tuple(row[_KEY_COLUMNS:])


def job_of_values(values: tuple[Any, ...]) -> Job:
    """A transient `Job` (in no session) holding `job_values`, decoded as the ORM would load them."""
    return Job(**dict(zip(_JOB_KEYS, decode_json_and_bools(_JOB_COLUMNS, values), strict=True)))


def get_job(session: Session, *, tenant_id: str, job_id: str, param: str = "fine_tuning_job_id") -> Job:
    """The tenant's job, or 404 naming `param` (also for another tenant's id: existence is not
    revealed)."""
    job = (
        session.scalar(_JOB_OF_TENANT, {"job_id": job_id, "tenant_id": tenant_id}) if is_id(job_id) else None
    )
    if job is None:
        raise NotFoundError(f"No fine-tuning job found with id {job_id!r}", param=param)
    return job


def list_jobs(
    session: Session,
    *,
    tenant_id: str,
    after: str | None,
    limit: int,
    status: str | None = None,
    metadata: dict[str, str] | None = None,
) -> tuple[list[Job], bool]:
    """Newest first, of one status where given, whose metadata holds every pair of `metadata`;
    `after` is the id of the last job of the previous page."""
    query = select(Job).where(Job.tenant_id == tenant_id)
    if status is not None:
        query = query.where(Job.status == status)
    for key, value in (metadata or {}).items():
        query = query.where(Job.metadata_[key].as_string() == value)
    if after is not None:
        query = query.where(Job.seq < _seq_of(session, Job, tenant_id, after, "after"))
    rows = list(session.scalars(query.order_by(Job.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def list_events(
    session: Session, *, tenant_id: str, job_id: str, after: str | None, limit: int
) -> tuple[list[JobEvent], bool]:
    """Newest first, as OpenAI lists them; `after` is an event id of the previous page."""
    get_job(session, tenant_id=tenant_id, job_id=job_id)
    query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type != OPERATOR_EVENT)
    if after is not None:
        cursor = (
            session.scalar(select(JobEvent.seq).where(JobEvent.id == after, JobEvent.job_id == job_id))
            if is_id(after)
            else None
        )
        if cursor is None:
            raise NotFoundError(f"unknown event id {after!r} for this job", param="after")
        query = query.where(JobEvent.seq < cursor)
    rows = list(session.scalars(query.order_by(JobEvent.seq.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def health_warnings(session: Session, *, job_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each job's training-health warnings ({"health", "step"}, in order), from its `warn` events."""
    found: dict[str, list[dict[str, Any]]] = {j: [] for j in job_ids}
    if not job_ids:
        return found
    rows = session.execute(
        select(JobEvent.job_id, JobEvent.data)
        .where(JobEvent.job_id.in_(job_ids), JobEvent.level == "warn")
        .order_by(JobEvent.seq)
    ).all()
    for job_id, data in rows:
        if isinstance(data, dict) and "health" in data:
            found[job_id].append({"health": data["health"], "step": data.get("step")})
    return found


def operator_events(session: Session, *, job_id: str) -> list[JobEvent]:
    """A job's operator-only events (tracebacks), oldest first: for `loraq jobs internal-errors`."""
    query = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.type == OPERATOR_EVENT)
    return list(session.scalars(query.order_by(JobEvent.seq)))


def list_checkpoints(
    session: Session, *, tenant_id: str, job_id: str, after: str | None, limit: int
) -> tuple[list[Checkpoint], bool]:
    """Newest (highest step) first; `after` is a checkpoint id of the previous page."""
    get_job(session, tenant_id=tenant_id, job_id=job_id)
    query = select(Checkpoint).where(Checkpoint.job_id == job_id)
    if after is not None:
        cursor = (
            session.scalar(select(Checkpoint.step).where(Checkpoint.id == after, Checkpoint.job_id == job_id))
            if is_id(after)
            else None
        )
        if cursor is None:
            raise NotFoundError(f"unknown checkpoint id {after!r} for this job", param="after")
        query = query.where(Checkpoint.step < cursor)
    rows = list(session.scalars(query.order_by(Checkpoint.step.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def checkpoints_by_step(session: Session, *, job_id: str) -> list[Checkpoint]:
    """Every checkpoint of a job (already looked up for its tenant), in step order."""
    return list(
        session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id).order_by(Checkpoint.step))
    )


def checkpoint_metrics(ckpt: Checkpoint) -> StoredCheckpointMetrics:
    """A checkpoint row's stored metrics and samples (a row stored without them has its step only)."""
    return StoredCheckpointMetrics.model_validate({"step": ckpt.step, **(ckpt.metrics or {})})


def get_checkpoint(session: Session, *, tenant_id: str, job_id: str, checkpoint_id: str) -> Checkpoint:
    get_job(session, tenant_id=tenant_id, job_id=job_id)
    ckpt = (
        None
        if not is_id(checkpoint_id)
        else session.scalar(
            select(Checkpoint).where(Checkpoint.id == checkpoint_id, Checkpoint.job_id == job_id)
        )
    )
    if ckpt is None:
        raise NotFoundError(f"No checkpoint found with id {checkpoint_id!r}", param="checkpoint_id")
    return ckpt


def get_adapter(session: Session, *, tenant_id: str, job_id: str) -> Artifact:
    job = get_job(session, tenant_id=tenant_id, job_id=job_id)
    artifact = session.scalar(select(Artifact).where(Artifact.job_id == job.id, Artifact.kind == "adapter"))
    if artifact is None:
        raise NotFoundError(
            f"fine-tuning job {job_id} has no adapter (status {job.status})", param="fine_tuning_job_id"
        )
    return artifact


def metric_rows(session: Session, *, job_id: str, after: int = 0, limit: int | None = None) -> list[StepRow]:
    """The job's stored steps greater than `after`, in step order (charts and the results CSV)."""
    rows = session.scalars(
        select(JobMetric)
        .where(JobMetric.job_id == job_id, JobMetric.step > after)
        .order_by(JobMetric.step)
        .limit(limit)
    )
    return [StepRow.model_validate(r) for r in rows]


def own_job_ids(session: Session, *, tenant_id: str, job_ids: list[str]) -> set[str]:
    """Those of `job_ids` that are the tenant's jobs."""
    return set(session.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.tenant_id == tenant_id)))


def succeeded_models(session: Session, *, tenant_id: str) -> list[tuple[str, int]]:
    """(fine_tuned_model, finished_at) of the tenant's succeeded jobs, oldest first."""
    rows = session.execute(
        select(Job.fine_tuned_model, Job.finished_at)
        .where(Job.tenant_id == tenant_id, Job.status == "succeeded", Job.fine_tuned_model.is_not(None))
        .order_by(Job.seq)
    ).all()
    return [(str(m), int(f or 0)) for m, f in rows]


def _seq_of(session: Session, model: type[Job], tenant_id: str, row_id: str, param: str) -> int:
    seq = (
        session.scalar(select(model.seq).where(model.id == row_id, model.tenant_id == tenant_id))
        if is_id(row_id)
        else None
    )
    if seq is None:
        raise NotFoundError(f"unknown id {row_id!r} in '{param}'", param=param)
    return int(seq)


# ---------------------------------------------------------------- create


def _training_file(
    session: Session, *, tenant_id: str, file_id: str, param: str, refuse_invalid: bool = True
) -> File:
    file = (
        session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id))
        if is_id(file_id)
        else None
    )
    if file is None:
        raise NotFoundError(
            f"invalid {param}: no file with id {file_id!r}", param=param, code="file_not_found"
        )
    if file.purpose != "fine-tune":
        raise InvalidRequestError(
            f"invalid {param}: file {file_id} has purpose {file.purpose!r}, expected 'fine-tune'",
            param=param,
            code="invalid_file_purpose",
        )
    if refuse_invalid and file.status == "error":
        raise InvalidRequestError(
            f"invalid {param}: file {file_id} failed validation at upload: {file.status_details}",
            param=param,
            code="invalid_file",
        )
    return file


def job_seed(spec: JobCreate) -> int:
    """The job's seed, or a random one: it draws the LoRA init, the data order and the holdout."""
    return spec.seed if spec.seed is not None else secrets.randbelow(MAX_SEED)


def validation_split(spec: JobCreate) -> float:
    """The share held out: none with a validation file, else the job's or the server's default."""
    if spec.validation_file is not None:
        return 0.0
    return spec.validation_split if spec.validation_split is not None else get_settings().validation_split


def check_target_modules(spec_targets: list[str] | str, model: str) -> None:
    """400 naming `lora.target_modules` when a name matches no linear layer of the model's family
    (Phi-3's are qkv_proj and gate_up_proj where the others split q/k/v and gate/up)."""
    from worker.engine.catalog import model_family  # pure Python

    if isinstance(spec_targets, str):
        return  # "all-linear" (the schema allows no other string)
    try:
        family = model_family(model, get_settings().model_store)
    except ModelError:
        return  # a local directory gone since `models add` (accepted with auto-pull, as before)
    layers = family.linear_modules
    for target in spec_targets:
        *parents, leaf = target.split(".")
        if leaf not in layers or (parents and parents[-1] != layers[leaf]):
            names = ", ".join(f"{parent}.{name}" for name, parent in layers.items())
            raise InvalidRequestError(
                f"invalid lora.target_modules: {target!r} is not a linear layer of model {model!r} "
                f"({family.architecture}); its linear layers are {names} (or 'all-linear')"
                + family.target_hint(leaf),
                param="lora.target_modules",
                code="invalid_target_modules",
            )


def check_max_seq_len(file: File, model: str, max_seq_len: int, param: str) -> bool:
    """400 naming `max_seq_len` when examples of the file are longer (the engine truncates nothing,
    so such a job would fail); counted with the model's tokenizer once per (file, tokenizer).
    False: not known yet, the file takes longer to count than a submit waits
    (`submit_count_seconds`); its job waits in `validating_files` (service/file_validation.py)."""
    from service.token_lengths import counter_for, lengths_now, too_long_message

    counter = counter_for(model)
    if counter is None:  # no torch-free tokenizer: the worker's validation decides
        return True
    found = lengths_now(file, counter, seconds=get_settings().submit_count_seconds)
    if found is None:
        return False
    message = too_long_message(param, found, max_seq_len)
    if message is not None:
        raise InvalidRequestError(message, param="max_seq_len", code=MAX_SEQ_LEN_TOO_SHORT)
    return True


def check_nodes(spec: JobCreate, *, celery_queue: str, workers: list[dict[str, Any]] | None) -> None:
    """Refuse a job on several hosts that cannot run: with integrations (their runs are opened by
    the worker that claims the job, before the rendezvous decides which host holds rank 0 and so
    reports the steps), or with fewer live workers on its queue than hosts (it needs them all at
    once; `workers` None: the registry could not be read, nothing is refused on it), unless
    `accept_unserved_jobs` (workers that start on demand)."""
    n = spec.n_nodes
    if n == 1:
        return
    if spec.integrations:
        raise InvalidRequestError(
            f"invalid n_nodes: a job on {n} hosts cannot log to integrations yet; "
            "use n_nodes 1, or follow its loss curve on the dashboard",
            param="n_nodes",
        )
    live = None if workers is None else sum(w.get("queue") == celery_queue for w in workers)
    if live is not None and live < n and not get_settings().accept_unserved_jobs:
        raise InvalidRequestError(
            f"invalid n_nodes: a job on {n} hosts needs {n} workers of queue {celery_queue!r} at once, "
            f"and {live} serve it now; start more, or set LORAQ_ACCEPT_UNSERVED_JOBS=1 for queues "
            "whose workers start on demand",
            param="n_nodes",
            code="no_worker_for_job",
        )


def routing_wait(
    *, queue: str, n_gpus: int, served_queues: set[str] | None, default_queue: str
) -> str | None:
    """What a job waits for when no live worker would take it now, or None.

    Refused (400) instead unless `accept_unserved_jobs`, except on the deployment's own queue,
    whose worker may be starting or restarting (`loraq up`). `served_queues` None: the registry
    could not be read, so nothing is known and nothing is refused.
    """
    from service.broker import celery_queue
    from service.worker_registry import unserved_reason

    if served_queues is None:
        return None
    reason = unserved_reason(queue, n_gpus, celery_queue(queue, n_gpus), served_queues)
    if reason is None:
        return None
    if celery_queue(queue, n_gpus) != default_queue and not get_settings().accept_unserved_jobs:
        param = "n_gpus" if reason.startswith("n_gpus") else "queue"
        raise InvalidRequestError(
            f"invalid {param}: {reason}; start such a worker, or set LORAQ_ACCEPT_UNSERVED_JOBS=1 "
            "for queues whose workers start on demand",
            param=param,
            code="no_worker_for_job",
        )
    return f"a worker: {reason}"


def requested_training(spec: JobCreate) -> TrainingConfig:
    """The request's training configuration: its method (`requested_method`) and hyperparameters,
    with Loraq's top-level training fields. "auto" and unset values are kept."""
    method, hp = requested_method(spec)
    return TrainingConfig(**(hp.model_dump() if hp is not None else {}), **spec.options(), method=method)


def requested_method(spec: JobCreate) -> tuple[TrainingMethod, Hyperparameters | None]:
    """The request's training method and its hyperparameters, 400 naming the field otherwise.

    Supervised: from `method.supervised.hyperparameters` (current API) or `hyperparameters`
    (deprecated), not both. DPO: from `method.dpo.hyperparameters` (beta, and Loraq's rpo_alpha,
    among them) only. A method type Loraq does not train (`reinforcement`) is
    `unsupported_method`."""
    method = spec.method
    kind = method.type if method is not None else "supervised"
    if kind not in METHOD_TYPES:
        raise InvalidRequestError(
            f"method.type {kind!r} is not supported: Loraq fine-tunes with "
            + " or ".join(repr(t) for t in METHOD_TYPES),
            param="method.type",
            code="unsupported_method",
        )
    assert method is not None or kind == "supervised"
    for other in ("supervised", "dpo", "reinforcement"):
        if other != kind and method is not None and getattr(method, other) is not None:
            raise InvalidRequestError(
                f"method.{other} is given but method.type is {kind!r}: give the hyperparameters of "
                f"method.{kind}",
                param=f"method.{other}",
            )
    if kind == "dpo":
        assert method is not None
        if spec.hyperparameters is not None:
            raise InvalidRequestError(
                "a dpo job takes its hyperparameters in 'method.dpo.hyperparameters' (beta among them), "
                "not in the top-level 'hyperparameters'",
                param="hyperparameters",
            )
        dpo_hp = method.dpo.hyperparameters if method.dpo is not None else None
        if dpo_hp is None:
            return DpoTraining(), None
        three = Hyperparameters(**dpo_hp.model_dump(exclude=set(DpoTraining.model_fields)))
        return DpoTraining(beta=dpo_hp.beta, rpo_alpha=dpo_hp.rpo_alpha), three
    method_hp = method.supervised.hyperparameters if method and method.supervised else None
    if method_hp is not None and spec.hyperparameters is not None:
        raise InvalidRequestError(
            "give hyperparameters either in 'hyperparameters' or in "
            "'method.supervised.hyperparameters', not both",
            param="hyperparameters",
        )
    return SupervisedTraining(), method_hp or spec.hyperparameters


def check_file_format(file: File, method: TrainingMethod, param: str) -> None:
    """400 naming the file when its format (as its upload check found it) is not the method's:
    a DPO job needs preference pairs, a supervised job chat, prompt/completion or text lines. A
    file stored before uploads kept their summary is left to the worker's loader."""
    found = (file.summary or {}).get("format")
    if found is None:
        return
    if method.type == "dpo" and found != PREFERENCE_FORMAT:
        raise InvalidRequestError(
            f"invalid {param}: file {file.id} is in the {found!r} format; a dpo job needs preference "
            'pairs, one per line: {"input": {"messages": [...]}, "preferred_output": '
            '[{"role": "assistant", ...}], "non_preferred_output": [{"role": "assistant", ...}]}',
            param=param,
            code="invalid_file_format",
        )
    if method.type == "supervised" and found == PREFERENCE_FORMAT:
        raise InvalidRequestError(
            f"invalid {param}: file {file.id} holds preference pairs (the dpo format); a supervised job "
            "needs chat ('messages'), 'prompt'+'completion' or 'text' lines, or set "
            "method.type to 'dpo'",
            param=param,
            code="invalid_file_format",
        )


def training_columns(training: TrainingConfig) -> dict[str, Any]:
    """The job row's columns that store `training` (JSON-ready values)."""
    data = training.model_dump(mode="json")
    columns = {name: data.pop(name) for name in TRAINING_COLUMNS}
    return {**columns, "hyperparameters": data}


def stored_training(job: Job | Row[Any]) -> TrainingConfig:
    """The training configuration of a job row (an ORM job or a `KEY_AND_JOB` row); a row stored
    before a field existed gets that field's default."""
    return TrainingConfig(**job.hyperparameters, **{name: getattr(job, name) for name in TRAINING_COLUMNS})


def request_digest(spec: JobCreate) -> str:
    """sha256 of the request as validated (defaults filled in, keys sorted): equal bodies, equal digests."""
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def replay(session: Session, *, tenant_id: str, key: str, request_sha256: str) -> Job | None:
    """The job an Idempotency-Key already made (Stripe's rules): the same body returns it; another
    body is a 409; after `idempotency_key_ttl_seconds` the key is released and may be used again."""
    job = _by_idempotency_key(session, tenant_id, key)
    if job is None:
        return None
    if job.created_at < now_s() - get_settings().idempotency_key_ttl_seconds:
        session.execute(
            update(Job).where(Job.id == job.id).values(idempotency_key=None),
            execution_options={"synchronize_session": False},
        )
        session.flush()
        return None
    if job.request_sha256 is not None and job.request_sha256 != request_sha256:
        raise ConflictError(
            f"Idempotency-Key {key!r} was already used with a different request body (it created job "
            f"{job.id}); send the same body to get that job again, or use a new key",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    return job


def check_job_inputs(
    session: Session, *, tenant_id: str, spec: JobCreate, refuse_invalid: bool = True
) -> tuple[File, File | None]:
    """The model exists and the files are the tenant's fine-tune files (404/400 otherwise);
    returns (training file, validation file or None). `refuse_invalid=False` (a dry run) lets a
    file that failed validation through, so the plan can list its bad lines."""
    settings = get_settings()
    # pure Python; imported here to keep startup light
    from worker.engine.catalog import get_model_info, model_family

    try:
        base = get_model_info(spec.model, settings.model_store)
    except ModelError as e:
        # 404 as OpenAI answers `model_not_found` (and as for files that do not exist): refused at
        # submit, naming `model` and the known ones
        raise NotFoundError(str(e), param="model", code="model_not_found") from e
    try:
        if base.pulled:  # a missing directory is a model not local, below
            model_family(spec.model, settings.model_store)
    except ModelError as e:
        # a local directory of an architecture Loraq does not train (its config.json may have
        # changed since `loraq models add`): the message names the supported architectures
        raise InvalidRequestError(str(e), param="model", code="unsupported_model") from e
    if not base.pulled and not settings.auto_pull:
        raise InvalidRequestError(
            f"base model {spec.model!r} is not local and LORAQ_AUTO_PULL=0: "
            f"run `loraq models pull {spec.model}` first",
            param="model",
            code="model_not_local",
        )
    if base.kind == "hub" and not base.pulled:
        from service.hub_models import check_hub_base  # the Hub look-up (huggingface_hub)

        check_hub_base(spec.model, settings.model_store)
    training = _training_file(
        session,
        tenant_id=tenant_id,
        file_id=spec.training_file,
        param="training_file",
        refuse_invalid=refuse_invalid,
    )
    validation = None
    if spec.validation_file is not None:
        validation = _training_file(
            session,
            tenant_id=tenant_id,
            file_id=spec.validation_file,
            param="validation_file",
            refuse_invalid=refuse_invalid,
        )
    return training, validation


def create_job(
    session: Session,
    *,
    tenant_id: str,
    spec: JobCreate,
    idempotency_key: str | None = None,
    served_queues: set[str] | None = None,
    served_integrations: dict[str, set[str]] | None = None,
) -> Job:
    """Validate the request, insert the job and move it to `queued`. The caller commits, then enqueues.

    Everything that would make the job fail later is refused here with a 400 naming the field:
    an unknown model, a file that failed validation, target modules the model lacks, a queue or
    GPU count no live worker serves (`served_queues`, see `routing_wait`), integrations none of
    its queue's live workers can log (`served_integrations`, see `integrations.check_served`).
    """
    digest = request_digest(spec)
    if idempotency_key is not None:
        existing = replay(session, tenant_id=tenant_id, key=idempotency_key, request_sha256=digest)
        if existing is not None:
            return existing

    settings = get_settings()
    waiting_for = check_job_limits(session, tenant_id=tenant_id)
    training, validation = check_job_inputs(session, tenant_id=tenant_id, spec=spec)
    requested = requested_training(spec)
    check_file_format(training, requested.method, "training_file")
    if validation is not None:
        check_file_format(validation, requested.method, "validation_file")
    check_target_modules(spec.lora.target_modules, spec.model)
    # each file checked (or its count found pending), so a short validation file still refuses now
    checked = [check_max_seq_len(training, spec.model, spec.max_seq_len, "training_file")]
    if validation is not None:
        checked.append(check_max_seq_len(validation, spec.model, spec.max_seq_len, "validation_file"))
    queue = spec.queue or settings.worker_queue
    waiting_for = waiting_for or routing_wait(
        queue=queue, n_gpus=spec.n_gpus, served_queues=served_queues, default_queue=settings.worker_queue
    )
    from service.broker import celery_queue

    integrations.check_served(
        spec.integrations, celery_queue=celery_queue(queue, spec.n_gpus), served=served_integrations
    )
    live_workers = worker_registry.live_workers_now()
    check_nodes(spec, celery_queue=celery_queue(queue, spec.n_gpus), workers=live_workers)
    memory_check.check_quantization(spec)
    memory_check.check_fits(
        spec,
        batch_size=requested.batch_size,
        celery_queue=celery_queue(queue, spec.n_gpus),
        workers=live_workers,
    )

    seed = job_seed(spec)
    config = requested.model_copy(update={"seed": seed, "validation_split": validation_split(spec)})
    job = Job(
        tenant_id=tenant_id,
        idempotency_key=idempotency_key,
        request_sha256=digest,
        waiting_for=waiting_for,
        model=spec.model,
        training_file=spec.training_file,
        validation_file=spec.validation_file,
        **training_columns(config),
        method_type=config.method.type,
        queue=queue,
        n_gpus=spec.n_gpus,
        n_nodes=spec.n_nodes,
        suffix=spec.suffix or None,
        metadata_=spec.metadata,
        integrations=integrations.stored(spec.integrations),
        status="validating_files",
        result_files=[],
    )
    session.add(job)
    try:
        session.flush()
    except IntegrityError:
        # Another request with the same Idempotency-Key won the race. The insert is this
        # transaction's first write, so rolling it all back loses nothing (and needs no SAVEPOINT,
        # which pysqlite would run outside a transaction); then return the winner's job.
        session.rollback()
        if idempotency_key is not None and (
            winner := _by_idempotency_key(session, tenant_id, idempotency_key)
        ):
            return winner
        raise
    add_event(session, job_id=job.id, level="info", message=f"Validating training file: {training.id}")
    if all(checked):
        files_validated(session, job_id=job.id, model=spec.model, waiting_for=waiting_for)
    session.refresh(job)
    return job


def files_validated(session: Session, *, job_id: str, model: str, waiting_for: str | None) -> bool:
    """validating_files → queued, with the events that say so; False if the job left
    `validating_files` meanwhile (cancelled). The caller commits, then enqueues."""
    if not _transition(session, job_id, "validating_files", "queued"):
        return False
    add_event(session, job_id=job_id, level="info", message="Files validated, moving job to queued state")
    if warning := random_weights_warning(model):
        add_event(session, job_id=job_id, level="warn", message=warning)
    if waiting_for is not None:
        add_event(session, job_id=job_id, level="info", message=f"Waiting for {waiting_for}")
    return True


def files_refused(session: Session, *, job_id: str, error: dict[str, Any]) -> bool:
    """validating_files → failed with the error a submit would have answered (OpenAI's body:
    code, message, param); False if the job left `validating_files` meanwhile."""
    if not _transition(session, job_id, "validating_files", "failed", error=error, finished_at=now_s()):
        return False
    add_event(session, job_id=job_id, level="error", message=error["message"])
    webhooks.job_ended(session, job_id=job_id, status="failed")
    return True


def check_job_limits(session: Session, *, tenant_id: str) -> str | None:
    """429 when the tenant already has `max_queued_jobs_per_tenant` jobs waiting (queued or
    validating); a limit of 0 is no limit. Checked when a job is submitted, so concurrent
    submissions can overshoot by the few that race.

    The running-job limit is enforced when a job starts (`claim_next`): a job submitted while the
    tenant is at it is accepted and waits; the returned words say for what (None: nothing)."""
    settings = get_settings()
    counts = active_counts(session, tenant_id=tenant_id)
    waiting = counts["queued"] + counts["validating_files"]
    if 0 < settings.max_queued_jobs_per_tenant <= waiting:
        raise RateLimitError(
            f"too many queued jobs: this organization has {waiting} jobs waiting to start and the "
            f"limit is {settings.max_queued_jobs_per_tenant}; wait for some to start or cancel one",
            code="too_many_queued_jobs",
        )
    if 0 < settings.max_running_jobs_per_tenant <= counts["running"]:
        return running_slot_wait(counts["running"], settings.max_running_jobs_per_tenant)
    return None


def running_slot_wait(running: int, limit: int) -> str:
    return (
        f"a running-job slot: this organization has {running} job(s) running and its limit is {limit}; "
        "the job starts when one finishes"
    )


def _by_idempotency_key(session: Session, tenant_id: str, key: str) -> Job | None:
    return session.scalar(select(Job).where(Job.tenant_id == tenant_id, Job.idempotency_key == key))


def _transition(session: Session, job_id: str, expected: str, new: str, **values: Any) -> bool:
    stmt = update(Job).where(Job.id == job_id, Job.status == expected).values(status=new, **values)
    return _run(session, stmt) == 1


def _run(session: Session, stmt: Update) -> int:
    result = session.execute(stmt.execution_options(synchronize_session=False))
    return int(result.rowcount)  # type: ignore[attr-defined]


def _fenced(claim: Claim) -> Update:
    return update(Job).where(
        Job.id == claim.job_id, Job.status == "running", Job.attempt_token == claim.attempt_token
    )


# ---------------------------------------------------------------- worker side


def claim_next(session: Session, *, job_id: str, worker_id: str) -> Claim | None:
    """What a worker's delivery of `job_id`'s message claims: the next job of the same routing
    (queue, n_gpus), round-robin across tenants, within each tenant's running-job limit.

    Tenants are ordered by (jobs running now, time of their last claim, oldest queued job): a
    tenant with ten queued jobs gets one slot in turn, not ten. A message whose job another
    delivery already took still claims the next one, so the number of wake-ups matches the number
    of queued jobs; extra ones (the reconciler re-sends) claim nothing and are dropped.
    """
    hint = session.execute(select(Job.queue, Job.n_gpus, Job.n_nodes).where(Job.id == job_id)).first()
    if hint is None:
        return None
    limit = get_settings().max_running_jobs_per_tenant
    for _ in range(MAX_CLAIM_TRIES):
        candidate = _next_fair(
            session, queue=hint.queue, n_gpus=hint.n_gpus, n_nodes=hint.n_nodes, running_limit=limit
        )
        if candidate is None:
            _mark_waiting(session, job_id=job_id, running_limit=limit)
            return None
        if limit > 0:
            # PostgreSQL: one claim per tenant at a time, so the count in the UPDATE is current.
            session.execute(select(Tenant.id).where(Tenant.id == candidate[1]).with_for_update())
        got = claim(session, job_id=candidate[0], worker_id=worker_id, running_limit=limit)
        if got is not None:
            return got
        session.commit()  # lost the race (or the limit): release the tenant lock, look again
    return None


def _next_fair(
    session: Session, *, queue: str, n_gpus: int, n_nodes: int, running_limit: int
) -> tuple[str, str] | None:
    """(job id, tenant id) of the job the round-robin picks next, or None."""
    other = aliased(Job)
    running = (
        select(other.tenant_id, func.count().label("n"))
        .where(other.status == "running")
        .group_by(other.tenant_id)
        .subquery()
    )
    waiting_tenants = select(Job.tenant_id).where(Job.status == "queued").distinct()
    last = (  # only tenants with queued jobs: no scan of every job the service ever ran
        select(other.tenant_id, func.max(other.claimed_at).label("at"))
        .where(other.tenant_id.in_(waiting_tenants))
        .group_by(other.tenant_id)
        .subquery()
    )
    head = (
        select(Job.tenant_id, func.min(Job.seq).label("seq"))
        .where(
            Job.status == "queued",
            Job.queue == queue,
            Job.n_gpus == n_gpus,
            Job.n_nodes == n_nodes,
            Job.cancel_requested.is_(False),
        )
        .group_by(Job.tenant_id)
        .subquery()
    )
    n_running = func.coalesce(running.c.n, 0)
    query = (
        select(head.c.seq, head.c.tenant_id)
        .outerjoin(running, running.c.tenant_id == head.c.tenant_id)
        .outerjoin(last, last.c.tenant_id == head.c.tenant_id)
        .order_by(n_running, last.c.at.is_not(None), last.c.at, head.c.seq)
        .limit(1)
    )
    if running_limit > 0:
        query = query.where(n_running < running_limit)
    row = session.execute(query).first()
    if row is None:
        return None
    job_id = session.scalar(select(Job.id).where(Job.seq == row.seq))
    return (str(job_id), str(row.tenant_id)) if job_id is not None else None


def _mark_waiting(session: Session, *, job_id: str, running_limit: int) -> None:
    """A delivery found nothing to claim: if `job_id` waits on its tenant's running-job limit,
    say so on the job and, when the reason is new, in its events. Where another delivery took
    `job_id` already (fair share: the delivery of a later job's message claims its tenant's
    oldest), the tenant's oldest job still queued on the same routing is the one whose message
    was used, and the one that waits."""
    if running_limit <= 0:
        return
    job = session.execute(
        select(Job.tenant_id, Job.status, Job.queue, Job.n_gpus, Job.n_nodes).where(Job.id == job_id)
    ).first()
    if job is None:
        return
    if job.status != "queued":
        same_routing = select(Job.id).where(
            Job.tenant_id == job.tenant_id, Job.status == "queued", Job.queue == job.queue,
            Job.n_gpus == job.n_gpus, Job.n_nodes == job.n_nodes,
        )  # fmt: skip
        waiting = session.scalar(same_routing.order_by(Job.seq).limit(1))
        if waiting is None:
            return
        job_id = waiting
    running = active_counts(session, tenant_id=job.tenant_id)["running"]
    if running < running_limit:
        return
    mark_waiting(session, job_id=job_id, reason=running_slot_wait(running, running_limit))


def mark_waiting(session: Session, *, job_id: str, reason: str) -> None:
    """Say on queued job `job_id` what it waits for; a reason that is new goes in its events too."""
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.status == "queued", Job.waiting_for.is_distinct_from(reason))
        .values(waiting_for=reason)
    )
    if _run(session, stmt) == 1:
        add_event(session, job_id=job_id, level="info", message=f"Waiting for {reason}")


def oldest_waiting(session: Session, *, tenant_id: str) -> str | None:
    """The tenant's oldest queued job that waits for something (`waiting_for` set), if any."""
    query = select(Job.id).where(
        Job.tenant_id == tenant_id, Job.status == "queued", Job.waiting_for.is_not(None)
    )
    return session.scalar(query.order_by(Job.seq).limit(1))


def claim(session: Session, *, job_id: str, worker_id: str, running_limit: int = 0) -> Claim | None:
    """queued → running for this worker: a new attempt with a fresh token; None if not claimable
    (no longer queued, cancel requested, or its tenant already runs `running_limit` jobs)."""
    token = secrets.token_hex(16)
    now = time.time()
    stmt = (
        update(Job)
        .where(Job.id == job_id, Job.status == "queued", Job.cancel_requested.is_(False))
        .values(
            status="running",
            attempt=Job.attempt + 1,
            attempt_token=token,
            worker_id=worker_id,
            heartbeat_at=now,
            claimed_at=now,
            waiting_for=None,
            started_at=func.coalesce(Job.started_at, int(now)),
        )
    )
    if running_limit > 0:
        # Evaluated inside the UPDATE (SQLite holds its write lock; PostgreSQL the tenant row lock
        # `claim_next` took), so two workers cannot both take a tenant's last slot.
        other = aliased(Job)
        tenant = select(Job.tenant_id).where(Job.id == job_id).scalar_subquery()
        n_running = (
            select(func.count())
            .select_from(other)
            .where(other.tenant_id == tenant, other.status == "running")
            .scalar_subquery()
        )
        stmt = stmt.where(n_running < running_limit)
    if _run(session, stmt) != 1:
        return None
    job = session.scalars(select(Job).where(Job.id == job_id).execution_options(populate_existing=True)).one()
    return _claim_of(session, job, token=token, worker_id=worker_id)


def join(session: Session, *, job_id: str, attempt: int, worker_id: str) -> Claim | None:
    """The claim of attempt `attempt` of a multi-host job for one more of its workers (the first
    claimed it: `claim`); None once that attempt has ended or the job is being cancelled. Every
    worker of the attempt writes with its token, so whichever holds rank 0 reports."""
    job = session.scalars(
        select(Job).where(
            Job.id == job_id,
            Job.status == "running",
            Job.attempt == attempt,
            Job.n_nodes > 1,
            Job.cancel_requested.is_(False),
        )
    ).first()
    if job is None or job.attempt_token is None:
        return None
    return _claim_of(session, job, token=job.attempt_token, worker_id=worker_id)


def _claim_of(session: Session, job: Job, *, token: str, worker_id: str) -> Claim | None:
    """The claim of `job`'s running attempt `token` (None: its files are gone, and it failed)."""
    job_id = job.id
    # "auto" stays as requested: the engine plans it from the tokenized data (`record_plan`)
    training = stored_training(job)
    files = {
        f.id: f.storage_key
        for f in session.scalars(
            select(File).where(File.id.in_([job.training_file, job.validation_file or ""]))
        )
    }
    missing = [f for f in (job.training_file, job.validation_file) if f is not None and f not in files]
    if missing:
        # Deleted between job creation and now (a race the delete check cannot close): fail the
        # job with the reason rather than hand a worker a claim it cannot run.
        message = f"file {missing[0]} was deleted before the job started"
        param = "training_file" if missing[0] == job.training_file else "validation_file"
        error = {"code": "file_not_found", "message": message, "param": param}
        fenced = update(Job).where(Job.id == job_id, Job.status == "running", Job.attempt_token == token)
        if _run(session, fenced.values(status="failed", error=error, finished_at=now_s())) == 1:
            add_event(session, job_id=job_id, level="error", message=message)
            webhooks.job_ended(session, job_id=job_id, status="failed")
        return None
    resume = session.execute(
        select(Checkpoint.storage_key, Checkpoint.step)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.step.desc())
        .limit(1)
    ).first()
    session.flush()
    return Claim(
        job_id=job.id,
        tenant_id=job.tenant_id,
        attempt=job.attempt,
        attempt_token=token,
        worker_id=worker_id,
        model=job.model,
        training_file=files[job.training_file],
        validation_file=files[job.validation_file] if job.validation_file else None,
        training=training,
        suffix=job.suffix,
        resume_checkpoint=resume.storage_key if resume is not None else None,
        resume_step=int(resume.step) if resume is not None else 0,
        n_gpus=job.n_gpus,
        n_nodes=job.n_nodes,
        paused_attempts=job.paused_attempts,
        integrations=tuple(integrations.of_job(job.integrations)),
    )


def record_plan(session: Session, *, claim: Claim, plan: dict[str, Any]) -> bool:
    """Store the engine's plan (the hyperparameters "auto" resolved to, shown from now on as
    OpenAI shows them once a job starts); False if this attempt was fenced out."""
    return _run(session, _fenced(claim).values(plan=plan)) == 1


def heartbeat(session: Session, *, claim: Claim) -> bool:
    """Refresh `heartbeat_at`; False once this attempt is fenced out (superseded or ended)."""
    return _run(session, _fenced(claim).values(heartbeat_at=time.time())) == 1


def add_event(
    session: Session,
    *,
    job_id: str,
    level: str,
    message: str,
    data: dict[str, Any] | None = None,
    type: str = "message",
) -> JobEvent:
    event = JobEvent(job_id=job_id, level=level, message=message, type=type, data=data)
    session.add(event)
    session.flush()
    return event


def _finite(x: float | None) -> float | None:
    # JSON has no NaN/inf (PostgreSQL refuses them in json columns): a non-finite value is null.
    return x if x is None or math.isfinite(x) else None


def record_metrics(session: Session, *, claim: Claim, rows: list[StepMetrics]) -> list[StepMetrics]:
    """Insert a batch of per-step metrics (steps already stored are skipped: a resumed attempt
    repeats steps after its checkpoint) with one `metrics` event each, and update progress.
    Returns the steps stored now, in order (what the job's integrations log)."""
    if not rows:
        return []
    last = max(reversed(rows), key=lambda m: m.step)  # the latest row of the highest step
    now = time.time()
    progress = _fenced(claim).values(
        step=last.step,
        total_steps=last.total_steps,
        train_loss=last.train_loss,
        tokens_per_s=last.tokens_per_s,
        padding_fraction=_finite(last.padding_fraction),
        eta_seconds=last.eta_seconds,
        trained_tokens=last.trained_tokens,
        estimated_finish=int(now + last.eta_seconds) if math.isfinite(last.eta_seconds) else None,
        heartbeat_at=now,
    )
    if _run(session, progress) != 1:
        raise StaleAttemptError(f"attempt {claim.attempt} of job {claim.job_id} no longer holds it")
    steps = sorted({m.step for m in rows})
    stored = set(
        session.scalars(
            select(JobMetric.step).where(JobMetric.job_id == claim.job_id, JobMetric.step.in_(steps))
        )
    )
    fresh: dict[int, StepMetrics] = {}
    for m in rows:
        if m.step not in stored:
            fresh[m.step] = m  # a step repeated inside one batch keeps its latest values
    if not fresh:
        return []
    ts = int(now)
    session.execute(
        insert(JobMetric),
        [
            {"job_id": claim.job_id, "created_at": ts, **StepRow.from_metrics(m).model_dump()}
            for m in fresh.values()
        ],
    )
    session.execute(
        insert(JobEvent),
        [
            {
                "job_id": claim.job_id,
                "created_at": ts,
                "level": "info",
                "type": "metrics",
                "message": f"Step {m.step}/{m.total_steps}: training loss={m.train_loss:.4f}",
                "data": event_data(m),
            }
            for m in sorted(fresh.values(), key=lambda m: m.step)
        ],
    )
    return sorted(fresh.values(), key=lambda m: m.step)


def register_checkpoint(
    session: Session,
    *,
    claim: Claim,
    step: int,
    storage_key: str,
    sha256: str,
    metrics: StoredCheckpointMetrics,
) -> Checkpoint:
    """Record a checkpoint zip already in the store. A step registered again (a resumed attempt
    repeating it) updates the row in place: checkpoint ids stay valid across resumes."""
    if _run(session, _fenced(claim).values(heartbeat_at=time.time())) != 1:
        raise StaleAttemptError(f"attempt {claim.attempt} of job {claim.job_id} no longer holds it")
    ckpt = session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == claim.job_id, Checkpoint.step == step)
    )
    record = metrics.model_dump()
    if ckpt is None:
        ckpt = Checkpoint(
            job_id=claim.job_id, step=step, storage_key=storage_key, sha256=sha256, metrics=record
        )
        session.add(ckpt)
    else:
        ckpt.storage_key, ckpt.sha256, ckpt.metrics = storage_key, sha256, record
    session.flush()
    add_event(session, job_id=claim.job_id, level="info", message=f"Checkpoint created at step {step}")
    return ckpt


def job_status(session: Session, *, job_id: str) -> str | None:
    return session.scalar(select(Job.status).where(Job.id == job_id))


def is_cancel_requested(session: Session, *, job_id: str) -> bool:
    flag = session.scalar(select(Job.cancel_requested).where(Job.id == job_id))
    return bool(flag)


def stop_requested(session: Session, *, job_id: str) -> Literal["cancel", "pause"] | None:
    """What a running job was asked to stop for, read by its worker at each step: a cancel wins
    over a pause requested before it."""
    row = session.execute(select(Job.cancel_requested, Job.pause_requested).where(Job.id == job_id)).first()
    if row is None or row.cancel_requested:
        return "cancel"  # a job that is gone stops too
    return "pause" if row.pause_requested else None


def _invalid_state(job_id: str, job: Job, action: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"fine-tuning job {job_id} is {job.status}{why}; it cannot be {action}",
        param="fine_tuning_job_id",
        code="invalid_job_state",
    )


def request_pause(session: Session, *, tenant_id: str, job_id: str) -> Job:
    """running → `pause_requested` (its worker stops at the next step with a checkpoint and ends it
    `paused`, freeing the GPU); queued → paused at once; paused stays paused. Anything else is a
    400: a job still validating its files, one with a cancel requested, one that ended."""
    job = get_job(session, tenant_id=tenant_id, job_id=job_id)
    if job.status == PAUSED:
        return job
    if job.status not in ("queued", "running") or job.cancel_requested:
        why = " with a cancel requested" if job.cancel_requested else ""
        raise _invalid_state(job_id, job, "paused", why)
    if _transition(session, job_id, "queued", PAUSED, waiting_for=None):
        add_event(session, job_id=job_id, level="info", message="Fine-tuning job paused before it started")
    else:
        stmt = (
            update(Job)
            .where(Job.id == job_id, Job.status == "running", Job.cancel_requested.is_(False))
            .values(pause_requested=True)
        )
        if _run(session, stmt) == 1 and not job.pause_requested:
            add_event(session, job_id=job_id, level="info", message="Pause requested")
    session.flush()
    session.refresh(job)
    return job


def request_resume(session: Session, *, tenant_id: str, job_id: str) -> Job:
    """paused → queued (the caller commits, then enqueues): the next worker resumes from the job's
    latest checkpoint. A running job whose pause was not reached yet just keeps running. Within
    the tenant's queued-job limit, as a submit is (429)."""
    job = get_job(session, tenant_id=tenant_id, job_id=job_id)
    if job.status == "running" and job.pause_requested:
        stmt = update(Job).where(Job.id == job_id, Job.status == "running").values(pause_requested=False)
        if _run(session, stmt) == 1:
            add_event(session, job_id=job_id, level="info", message="Pause withdrawn; the job keeps running")
    elif job.status != PAUSED:
        raise _invalid_state(job_id, job, "resumed", "" if job.status in TERMINAL else ", not paused")
    else:
        waiting_for = check_job_limits(session, tenant_id=tenant_id)
        if _transition(session, job_id, PAUSED, "queued", waiting_for=waiting_for):
            saved = session.scalar(select(func.max(Checkpoint.step)).where(Checkpoint.job_id == job_id))
            at = f"its checkpoint at step {saved}" if saved else "step 0"
            add_event(session, job_id=job_id, level="info", message=f"Fine-tuning job resumed from {at}")
    session.flush()
    session.refresh(job)
    return job


def pause(session: Session, *, claim: Claim, step: int) -> bool:
    """running → paused for this attempt, which stopped on a pause request (`step`: that of the
    checkpoint it resumes from, 0: none); False if fenced out or the pause was withdrawn (or
    overtaken by a cancel) meanwhile."""
    values = {**_RELEASED, "paused_attempts": Job.paused_attempts + 1}
    asked = _fenced(claim).where(Job.pause_requested.is_(True), Job.cancel_requested.is_(False))
    if _run(session, asked.values(status=PAUSED, **values)) != 1:
        return False
    kept = f"at step {step}; a resume continues from its checkpoint" if step else "before its first step"
    add_event(session, job_id=claim.job_id, level="info", message=f"Fine-tuning job paused {kept}")
    return True


def request_cancel(session: Session, *, tenant_id: str, job_id: str) -> Job:
    """queued → cancelled at once; running → `cancel_requested`, the worker ends it `cancelled`."""
    job = get_job(session, tenant_id=tenant_id, job_id=job_id)
    if job.status in ("succeeded", "failed"):
        raise InvalidRequestError(
            f"fine-tuning job {job_id} already {job.status}; it cannot be cancelled",
            param="fine_tuning_job_id",
            code="invalid_job_state",
        )
    if job.status != "cancelled":
        for status in ("validating_files", "queued", PAUSED):
            if _transition(session, job_id, status, "cancelled", cancel_requested=True, finished_at=now_s()):
                add_event(session, job_id=job_id, level="info", message="Fine-tuning job cancelled")
                webhooks.job_ended(session, job_id=job_id, status="cancelled")
                break
        else:
            stmt = update(Job).where(Job.id == job_id, Job.status == "running").values(cancel_requested=True)
            if _run(session, stmt) == 1 and not job.cancel_requested:
                add_event(session, job_id=job_id, level="info", message="Cancellation requested")
    session.flush()
    session.refresh(job)
    return job


def finish(
    session: Session,
    *,
    claim: Claim,
    status: str,
    error: dict[str, Any] | None = None,
    trained_tokens: int | None = None,
    adapter_key: str | None = None,
    adapter_sha256: str | None = None,
    result_file_id: str | None = None,
    fine_tuned_model: str | None = None,
) -> bool:
    """running → succeeded | failed | cancelled for this attempt; False if fenced out."""
    if status not in TERMINAL:
        raise ValueError(f"finish status must be one of {TERMINAL}, got {status!r}")
    values: dict[str, Any] = {
        "status": status,
        "finished_at": now_s(),
        "estimated_finish": None,
        "pause_requested": False,
        "error": error,
        "fine_tuned_model": fine_tuned_model if status == "succeeded" else None,
        "result_files": [result_file_id] if result_file_id else [],
    }
    if trained_tokens is not None:
        values["trained_tokens"] = trained_tokens
    if _run(session, _fenced(claim).values(**values)) != 1:
        return False
    webhooks.job_ended(session, job_id=claim.job_id, status=status)
    if adapter_key is not None:
        if adapter_sha256 is None:
            raise ValueError("adapter_sha256 is required with adapter_key")
        from service.storage import default_store

        size = default_store().size(adapter_key)
        session.add(
            Artifact(
                job_id=claim.job_id,
                kind="adapter",
                storage_key=adapter_key,
                sha256=adapter_sha256,
                bytes=size,
            )
        )
    if result_file_id is not None:
        file = session.scalar(select(File).where(File.id == result_file_id))
        if file is not None:
            session.add(
                Artifact(
                    job_id=claim.job_id,
                    kind="results",
                    storage_key=file.storage_key,
                    sha256=file.sha256,
                    bytes=file.bytes,
                )
            )
    session.flush()
    return True


# ---------------------------------------------------------------- reliability hooks


def _silent_attempt(job_id: str, attempt_token: str, *, cancel_requested: bool) -> Update:
    """The UPDATE that releases attempt `attempt_token` of a running job, fenced on the token and
    on whether a cancel was requested."""
    return update(Job).where(
        Job.id == job_id,
        Job.status == "running",
        Job.attempt_token == attempt_token,
        Job.cancel_requested.is_(cancel_requested),
    )


def cancel_stale(session: Session, *, job_id: str, attempt_token: str, reason: str) -> bool:
    """running → cancelled for a silent attempt whose job had a cancel requested: the worker that
    would have ended it `cancelled` is gone, so the cancel ends it here instead of a re-queue."""
    stmt = _silent_attempt(job_id, attempt_token, cancel_requested=True).values(
        status="cancelled", attempt_token=None, finished_at=now_s(), estimated_finish=None
    )
    if _run(session, stmt) != 1:
        return False
    add_event(session, job_id=job_id, level="info", message=f"Fine-tuning job cancelled: {reason}")
    webhooks.job_ended(session, job_id=job_id, status="cancelled")
    return True


def cancel_requested_queued(session: Session) -> list[str]:
    """queued → cancelled for every queued job with a cancel requested (no worker claims such a
    job, and a cancel request on a queued job ends it at once: one left by a release before
    `cancel_stale` existed would otherwise wait for a second cancel). Their ids."""
    ids = list(session.scalars(select(Job.id).where(Job.status == "queued", Job.cancel_requested.is_(True))))
    ended = [
        job_id
        for job_id in ids
        if _transition(session, job_id, "queued", "cancelled", finished_at=now_s(), estimated_finish=None)
    ]
    for job_id in ended:
        add_event(session, job_id=job_id, level="info", message="Fine-tuning job cancelled")
        webhooks.job_ended(session, job_id=job_id, status="cancelled")
    return ended


# What releasing a running attempt clears: its token (the released worker's later writes are
# refused), its worker and the finish estimate of a run no longer running.
_RELEASED: dict[str, Any] = {
    "attempt_token": None,
    "worker_id": None,
    "heartbeat_at": None,
    "estimated_finish": None,
    "pause_requested": False,
}


def requeue(session: Session, *, job_id: str, attempt_token: str, reason: str) -> bool:
    """running → queued for a job whose attempt `attempt_token` went silent; the token is cleared
    so the silent worker's later writes are refused. The caller re-sends the job after commit.
    Never a job with a cancel requested (`cancel_stale` ends that one): a cancel that lands
    between the two leaves the job running for the next tick, which cancels it. A job with a
    pause requested goes to `paused` instead (False: nothing to re-send)."""
    released = _silent_attempt(job_id, attempt_token, cancel_requested=False)
    paused = released.where(Job.pause_requested.is_(True)).values(status=PAUSED, **_RELEASED)
    if _run(session, paused) == 1:  # a pause was requested: it is reached here, with nothing to send
        add_event(session, job_id=job_id, level="info", message=f"Fine-tuning job paused: {reason}")
        return False
    if _run(session, released.values(status="queued", **_RELEASED)) != 1:
        return False
    add_event(session, job_id=job_id, level="warn", message=f"Job re-queued: {reason}")
    return True


def fail_stale(session: Session, *, job_id: str, attempt_token: str, reason: str) -> bool:
    """running → failed for a silent attempt that used up its retries (and had no cancel
    requested: `cancel_stale` ends that one)."""
    error = {"code": "worker_lost", "message": reason, "param": None}
    stmt = _silent_attempt(job_id, attempt_token, cancel_requested=False).values(
        status="failed", error=error, finished_at=now_s(), estimated_finish=None
    )
    if _run(session, stmt) != 1:
        return False
    add_event(session, job_id=job_id, level="error", message=reason)
    webhooks.job_ended(session, job_id=job_id, status="failed")
    return True


def stale_running_jobs(session: Session, *, older_than: float) -> list[tuple[str, str, int]]:
    """(job id, attempt token, attempt) of running jobs whose last heartbeat is before `older_than`;
    the attempt counts retries only (attempts that ended in a pause are not)."""
    rows = session.execute(
        select(Job.id, Job.attempt_token, Job.attempt - Job.paused_attempts).where(
            Job.status == "running", Job.heartbeat_at < older_than
        )
    ).all()
    return [(i, str(t), int(a)) for i, t, a in rows]


def running_jobs_of_worker(session: Session, *, host: str, pid: int) -> list[tuple[str, str, int]]:
    """(job id, attempt token, attempt) of running jobs held by process `pid` on `host` (worker ids
    are `host:<device>:pid`, see worker.launcher.worker_identity); the attempt counts retries only."""
    rows = session.execute(
        select(Job.id, Job.attempt_token, Job.attempt - Job.paused_attempts).where(
            Job.status == "running", Job.worker_id.like(f"{host}:%:{pid}")
        )
    ).all()
    return [(i, str(t), int(a)) for i, t, a in rows]


def queued_jobs(session: Session) -> list[tuple[str, str, int]]:
    """(job id, worker class, n_gpus) of every `queued` job, oldest first (for the reconciler)."""
    rows = session.execute(
        select(Job.id, Job.queue, Job.n_gpus).where(Job.status == "queued").order_by(Job.seq)
    ).all()
    return [(i, str(q), int(n)) for i, q, n in rows]


def active_counts(session: Session, *, tenant_id: str) -> dict[str, int]:
    """How many of the tenant's jobs are in each active status (missing statuses count 0)."""
    rows = session.execute(
        select(Job.status, func.count())
        .where(Job.tenant_id == tenant_id, Job.status.in_(ACTIVE))
        .group_by(Job.status)
    ).all()
    counts: dict[str, int] = dict.fromkeys(ACTIVE, 0)
    counts.update({str(s): int(n) for s, n in rows})
    return counts
