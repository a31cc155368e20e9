"""SQLAlchemy 2 typed models: the database is the source of truth for tenants, keys, files, jobs,
their events, per-step metrics, checkpoints and artifacts.

Portable across SQLite and PostgreSQL: times are unix seconds (integers, as OpenAI returns them;
`heartbeat_at` is a float for sub-second staleness checks), structured fields are JSON, and every
public id is a prefixed random string (`file-…`, `ftjob-…`). Rows that are listed with cursor
pagination also carry `seq`, an autoincrement integer that orders them by insertion.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def now_s() -> int:
    return int(time.time())


# What `new_id` makes: a lowercase prefix, "-", url-safe characters. Anything else (NUL bytes,
# which PostgreSQL refuses in text, or very long strings) names no row and is never sent to the DB.
_ID_RE = re.compile(r"^[a-z]{2,16}-[A-Za-z0-9_-]{1,64}$")


def is_id(value: str) -> bool:
    return bool(_ID_RE.match(value))


def new_id(prefix: str) -> str:
    """`prefix-` + 24 url-safe random characters (144 bits): unguessable, so ids leak nothing."""
    return f"{prefix}-{secrets.token_urlsafe(18)}"


# SQLite only autoincrements an INTEGER PRIMARY KEY; BigInteger renders as BIGINT there.
SeqType = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("org"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    prefix: Mapped[str] = mapped_column(String(32), unique=True)
    # hex HMAC-SHA256(server secret, key); the plaintext is never stored
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, default=None)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_seq", "tenant_id", "seq"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("file"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    storage_key: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16), default="processed")  # processed | error
    status_details: Mapped[str | None] = mapped_column(Text, default=None)  # the first bad lines
    # the upload's structural check (service/api/dataset_summary.py, `DatasetSummary.to_dict`),
    # kept so the dashboard never parses the file again; NULL for files stored before it was
    summary: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_tenant_seq", "tenant_id", "seq"),
        Index("ix_jobs_status", "status"),
        UniqueConstraint("tenant_id", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftjob"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    idempotency_key: Mapped[str | None] = mapped_column(String(255), default=None)
    # sha256 of the request body the key was first used with: another body under the key is a 409
    request_sha256: Mapped[str | None] = mapped_column(String(64), default=None)

    # what the client asked for (OpenAI fields + our `lora` block and `max_seq_len`)
    model: Mapped[str] = mapped_column(String(128))
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64), default=None)
    # OpenAI's {"n_epochs", "batch_size", "learning_rate_multiplier"} as requested (numbers or
    # "auto") and the other training fields without a column of their own (service.jobs.training_columns)
    hyperparameters: Mapped[dict[str, Any]] = mapped_column(JSON)
    # what the engine planned once it had tokenized the data (worker.engine.training_config.plan_auto):
    # {"hyperparameters": the three resolved, "row_tokens", "message"}; null until then
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    method_type: Mapped[str] = mapped_column(String(32), default="supervised")
    lora: Mapped[dict[str, Any]] = mapped_column(JSON)
    max_seq_len: Mapped[int] = mapped_column(Integer)
    # deployment: the worker class whose queue runs the job, and the GPUs it needs on one
    # host (> 1: torchrun); the Celery queue is service.broker.celery_queue(queue, n_gpus)
    queue: Mapped[str] = mapped_column(String(48), default="default", server_default="default")
    n_gpus: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # hosts the job spans (> 1: that many workers of its queue, joined by a c10d rendezvous)
    n_nodes: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # pack examples into rows of max_seq_len tokens (padding-free); false: one example per row
    packing: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    suffix: Mapped[str | None] = mapped_column(String(64), default=None)
    seed: Mapped[int] = mapped_column(BigInteger)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON, default=None)
    # OpenAI's `integrations` as validated (service.schemas.Integration): where the worker logs
    integrations: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON, default=None)
    eval_prompts: Mapped[list[str] | None] = mapped_column(JSON, default=None)  # sampled at checkpoints

    # lifecycle
    status: Mapped[str] = mapped_column(String(24))
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # a pause a running job was asked for: its worker stops at the next step with a checkpoint
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # attempts that ended in a pause: they do not count against `max_attempts` (service/reaper.py)
    paused_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # a queued job's reason for not starting yet, in words (tenant limit, no worker for its queue)
    waiting_for: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    started_at: Mapped[int | None] = mapped_column(BigInteger, default=None)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, default=None)
    estimated_finish: Mapped[int | None] = mapped_column(BigInteger, default=None)

    # fencing: every worker write carries the attempt token of its claim
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    attempt_token: Mapped[str | None] = mapped_column(String(64), default=None)
    worker_id: Mapped[str | None] = mapped_column(String(255), default=None)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, default=None)
    claimed_at: Mapped[float | None] = mapped_column(Float, default=None)  # last claim: fair share order

    # progress (latest step) and results
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, default=None)
    train_loss: Mapped[float | None] = mapped_column(Float, default=None)
    tokens_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    eta_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    padding_fraction: Mapped[float | None] = mapped_column(Float, default=None)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, default=None)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(255), default=None, index=True)
    result_files: Mapped[list[Any]] = mapped_column(JSON, default=list)


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_seq", "job_id", "seq"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftevent"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    level: Mapped[str] = mapped_column(String(8))  # info | warn | error
    message: Mapped[str] = mapped_column(Text)
    type: Mapped[str] = mapped_column(String(16), default="message")  # message | metrics
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)


class JobMetric(Base):
    __tablename__ = "job_metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_job_metrics_job_step"),)

    id: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    train_loss: Mapped[float] = mapped_column(Float)
    valid_loss: Mapped[float | None] = mapped_column(Float, default=None)
    lr: Mapped[float] = mapped_column(Float)
    grad_norm: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(BigInteger)
    tokens_per_s: Mapped[float] = mapped_column(Float)
    step_seconds: Mapped[float] = mapped_column(Float)
    # a DPO step's readings (service/step_metrics.py StepRow); NULL for supervised jobs
    chosen_reward: Mapped[float | None] = mapped_column(Float, default=None)
    rejected_reward: Mapped[float | None] = mapped_column(Float, default=None)
    reward_margin: Mapped[float | None] = mapped_column(Float, default=None)
    reward_accuracy: Mapped[float | None] = mapped_column(Float, default=None)
    valid_reward_margin: Mapped[float | None] = mapped_column(Float, default=None)
    valid_reward_accuracy: Mapped[float | None] = mapped_column(Float, default=None)
    chosen_nll: Mapped[float | None] = mapped_column(Float, default=None)  # migration 0012
    valid_chosen_nll: Mapped[float | None] = mapped_column(Float, default=None)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("ftckpt"))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    storage_key: Mapped[str] = mapped_column(String(512))
    sha256: Mapped[str] = mapped_column(String(64))
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class Artifact(Base):
    """A job's output in the store: `adapter` (PEFT zip) or `results` (metrics CSV file)."""

    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "kind", name="uq_artifacts_job_kind"),)

    id: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    storage_key: Mapped[str] = mapped_column(String(512))
    sha256: Mapped[str] = mapped_column(String(64))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)


class WebhookEndpoint(Base):
    """An HTTPS URL a tenant registered for its jobs' status events (service/webhooks.py). The
    signing secret is kept as given to the user once (`whsec_` + base64): the sender needs it to
    sign, so it cannot be hashed like an API key."""

    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_seq", "tenant_id", "seq"),)

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, default=lambda: new_id("whep"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(Text)
    description: Mapped[str | None] = mapped_column(String(512), default=None)
    events: Mapped[list[str]] = mapped_column(JSON)  # the event types it receives
    secret: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    # set when the receiver answered 410 Gone (Standard Webhooks: stop sending), with why
    disabled_at: Mapped[int | None] = mapped_column(BigInteger, default=None)
    disabled_reason: Mapped[str | None] = mapped_column(Text, default=None)
    deleted_at: Mapped[int | None] = mapped_column(BigInteger, default=None)  # deliveries stay visible


class WebhookDelivery(Base):
    """One event for one endpoint: the outbox row a job transition writes in its own transaction,
    then the sender's state. `id` is the `webhook-id` header, the same on every retry."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "state", "next_attempt_at"),
        Index("ix_webhook_deliveries_job", "job_id", "seq"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "seq"),
    )

    seq: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    event_id: Mapped[str] = mapped_column(String(64))  # the payload's `id` (shared by its endpoints)
    event_type: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    # NULL: the operator's endpoint from the settings (LORAQ_WEBHOOK_OPERATOR_URL)
    endpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"), default=None
    )
    body: Mapped[str] = mapped_column(Text)  # exactly the bytes signed and sent (UTF-8 JSON)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now_s)
    state: Mapped[str] = mapped_column(String(16), default="pending")  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    # a sender holds the row until then (its token fences the result it writes back)
    lease_until: Mapped[float | None] = mapped_column(Float, default=None)
    lease_token: Mapped[str | None] = mapped_column(String(32), default=None)
    last_status: Mapped[int | None] = mapped_column(Integer, default=None)
    last_error: Mapped[str | None] = mapped_column(Text, default=None)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, default=None)


class WebhookAttempt(Base):
    """One HTTP request of a delivery: what the receiver answered, or why there was no answer."""

    __tablename__ = "webhook_attempts"
    __table_args__ = (
        UniqueConstraint("delivery_id", "attempt", name="uq_webhook_attempts_delivery_attempt"),
    )

    id: Mapped[int] = mapped_column(SeqType, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(ForeignKey("webhook_deliveries.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[float] = mapped_column(Float)
    duration_ms: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
