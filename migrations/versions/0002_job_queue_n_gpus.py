"""jobs.queue and jobs.n_gpus: route a job to a worker class's queue; GPUs it needs on one host

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 06:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # server defaults: rows that exist already are "default"-queue, one-GPU jobs
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("queue", sa.String(length=48), server_default="default", nullable=False))
        batch_op.add_column(sa.Column("n_gpus", sa.Integer(), server_default="1", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("n_gpus")
        batch_op.drop_column("queue")
