"""The governor's local-prefill threshold decisions.

Each planning pass records, per deployment, the threshold it put in force (the planner's value
or an operator's pin), what the planner computed, whether it was published to the routers (and
as which version) and the inputs it was computed from.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
UTC_TIME = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pdserve_threshold_decisions",
        sa.Column("id", ROW_ID, autoincrement=True, nullable=False),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("at", UTC_TIME, nullable=False),
        sa.Column("threshold_tokens", sa.Integer(), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("computed_tokens", sa.Integer(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("is_published", sa.Boolean(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("inputs", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_threshold_decisions"),
    )
    op.create_index("ix_pdserve_threshold_decisions_deployment_at",
                    "pdserve_threshold_decisions", ["deployment", "at"])


def downgrade() -> None:
    op.drop_index("ix_pdserve_threshold_decisions_deployment_at",
                  table_name="pdserve_threshold_decisions")
    op.drop_table("pdserve_threshold_decisions")
