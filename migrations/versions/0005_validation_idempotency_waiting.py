"""files.status_details (why an upload is `error`); jobs.request_sha256 (Idempotency-Key bodies
compared); jobs.waiting_for (why a queued job has not started); jobs.claimed_at (fair share)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.add_column(sa.Column("status_details", sa.Text(), nullable=True))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("request_sha256", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("waiting_for", sa.Text(), nullable=True))
        batch_op.add_column(sa.Column("claimed_at", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("claimed_at")
        batch_op.drop_column("waiting_for")
        batch_op.drop_column("request_sha256")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_column("status_details")
