"""Request windows carry the router replica that counted them.

Several router replicas each aggregate the requests they served; keyed only by (deployment,
window_start, window_s), the replicas' windows replaced one another and requests went uncounted.
The key now includes ``source`` (the replica's id); readers sum over sources.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

_OLD = "uq_pdserve_request_windows_deployment_window_start_window_s"
_NEW = "uq_pdserve_request_windows_window_source"  # Postgres names are <= 63 bytes


def upgrade() -> None:
    with op.batch_alter_table("pdserve_request_windows") as batch:
        batch.add_column(sa.Column("source", sa.String(128), nullable=False, server_default=""))
        batch.drop_constraint(_OLD, type_="unique")
        batch.create_unique_constraint(_NEW, ["deployment", "window_start", "window_s", "source"])


def downgrade() -> None:
    with op.batch_alter_table("pdserve_request_windows") as batch:
        batch.drop_constraint(_NEW, type_="unique")
        batch.create_unique_constraint(_OLD, ["deployment", "window_start", "window_s"])
        batch.drop_column("source")
