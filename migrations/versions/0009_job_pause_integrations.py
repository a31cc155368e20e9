"""jobs.pause_requested and jobs.paused_attempts (pause and resume); jobs.integrations (W&B, MLflow)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27 12:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("pause_requested", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
        batch_op.add_column(sa.Column("paused_attempts", sa.Integer(), server_default="0", nullable=False))
        batch_op.add_column(sa.Column("integrations", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("integrations")
        batch_op.drop_column("paused_attempts")
        batch_op.drop_column("pause_requested")
