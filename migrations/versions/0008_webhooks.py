"""webhook_endpoints, webhook_deliveries (the outbox of job status events), webhook_attempts

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SEQ = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(length=64), nullable=False, unique=True),
        sa.Column(
            "tenant_id", sa.String(length=64), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("description", sa.String(length=512), nullable=True),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("secret", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("disabled_at", sa.BigInteger(), nullable=True),
        sa.Column("disabled_reason", sa.Text(), nullable=True),
        sa.Column("deleted_at", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_webhook_endpoints_tenant_seq", "webhook_endpoints", ["tenant_id", "seq"])
    op.create_table(
        "webhook_deliveries",
        sa.Column("seq", SEQ, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(length=64), nullable=False, unique=True),
        sa.Column("event_id", sa.String(length=64), nullable=False),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column(
            "job_id", sa.String(length=64), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column(
            "endpoint_id",
            sa.String(length=64),
            sa.ForeignKey("webhook_endpoints.id", ondelete="CASCADE"),
            nullable=True,
        ),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.Float(), nullable=False),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("lease_token", sa.String(length=32), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
    )
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["state", "next_attempt_at"])
    op.create_index("ix_webhook_deliveries_job", "webhook_deliveries", ["job_id", "seq"])
    op.create_index("ix_webhook_deliveries_endpoint", "webhook_deliveries", ["endpoint_id", "seq"])
    op.create_table(
        "webhook_attempts",
        sa.Column("id", SEQ, primary_key=True, autoincrement=True),
        sa.Column(
            "delivery_id",
            sa.String(length=64),
            sa.ForeignKey("webhook_deliveries.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("duration_ms", sa.Float(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("delivery_id", "attempt", name="uq_webhook_attempts_delivery_attempt"),
    )


def downgrade() -> None:
    op.drop_table("webhook_attempts")
    op.drop_index("ix_webhook_deliveries_endpoint", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_job", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index("ix_webhook_endpoints_tenant_seq", table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
