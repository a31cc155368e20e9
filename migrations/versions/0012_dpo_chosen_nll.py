"""job_metrics: a DPO step's chosen answers' NLL per token under the policy (the term the loss adds
× rpo_alpha), and the validation pass's

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 19:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.add_column(sa.Column("chosen_nll", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("valid_chosen_nll", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        batch_op.drop_column("valid_chosen_nll")
        batch_op.drop_column("chosen_nll")
