"""job_metrics: a DPO step's readings (rewards of the chosen and rejected answers, margin, accuracy;
the validation pass's margin and accuracy)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 12:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = (
    "chosen_reward",
    "rejected_reward",
    "reward_margin",
    "reward_accuracy",
    "valid_reward_margin",
    "valid_reward_accuracy",
)


def upgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("job_metrics", schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
