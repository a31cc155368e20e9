"""jobs.packing (padding-free packed rows, default on) and jobs.padding_fraction (progress)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 09:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # rows that exist already were trained (or will be) as jobs are now by default: packed
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("packing", sa.Boolean(), server_default=sa.true(), nullable=False))
        batch_op.add_column(sa.Column("padding_fraction", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("padding_fraction")
        batch_op.drop_column("packing")
