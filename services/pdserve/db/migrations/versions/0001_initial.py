"""Initial schema: deployments and the history of workers, plans, decisions, requests,
transfers and expert placements.

Revision 0001, the first. Written by hand to match ``pdserve.db.models``; the schema-diff tests
check that it does. Types are spelled out here rather than imported from the models, so this
revision keeps meaning the same thing when the models move on.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
UTC_TIME = sa.DateTime(timezone=True)


def _id() -> sa.Column:
    return sa.Column("id", ROW_ID, autoincrement=True, nullable=False)


def upgrade() -> None:
    op.create_table(
        "pdserve_deployments",
        _id(),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("gpu", sa.String(64), nullable=False),
        sa.Column("tp_size", sa.Integer(), nullable=False),
        sa.Column("config", JSON, nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("updated_at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_deployments"),
        sa.UniqueConstraint("name", name="uq_pdserve_deployments_name"),
    )

    op.create_table(
        "pdserve_worker_events",
        _id(),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_worker_events"),
    )
    op.create_index("ix_pdserve_worker_events_deployment_at", "pdserve_worker_events",
                    ["deployment", "at"])
    op.create_index("ix_pdserve_worker_events_worker_id_at", "pdserve_worker_events",
                    ["worker_id", "at"])

    op.create_table(
        "pdserve_capacity_plans",
        _id(),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("num_prefill_instances", sa.Integer(), nullable=False),
        sa.Column("num_decode_instances", sa.Integer(), nullable=False),
        sa.Column("predicted_ttft_ms", sa.Double(), nullable=False),
        sa.Column("predicted_tpot_ms", sa.Double(), nullable=False),
        sa.Column("local_prefill_threshold_tokens", sa.Integer(), nullable=False),
        sa.Column("inputs", JSON, nullable=False),
        sa.Column("outputs", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_capacity_plans"),
    )
    op.create_index("ix_pdserve_capacity_plans_deployment_created_at", "pdserve_capacity_plans",
                    ["deployment", "created_at"])

    op.create_table(
        "pdserve_scaling_decisions",
        _id(),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("at", UTC_TIME, nullable=False),
        sa.Column("num_current_instances", sa.Integer(), nullable=False),
        sa.Column("num_target_instances", sa.Integer(), nullable=False),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("is_dry_run", sa.Boolean(), nullable=False),
        sa.Column("inputs", JSON, nullable=False),
        sa.Column("forecast", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_scaling_decisions"),
    )
    op.create_index("ix_pdserve_scaling_decisions_deployment_at", "pdserve_scaling_decisions",
                    ["deployment", "at"])

    op.create_table(
        "pdserve_request_windows",
        _id(),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("window_start", UTC_TIME, nullable=False),
        sa.Column("window_s", sa.Double(), nullable=False),
        sa.Column("num_requests", sa.Integer(), nullable=False),
        sa.Column("num_ok", sa.Integer(), nullable=False),
        sa.Column("num_ttft_slo_misses", sa.Integer(), nullable=False),
        sa.Column("num_tpot_slo_misses", sa.Integer(), nullable=False),
        sa.Column("num_errors", sa.Integer(), nullable=False),
        sa.Column("goodput_rps", sa.Double(), nullable=False),
        *(sa.Column(f"{metric}_p{q}_ms", sa.Double(), nullable=True)
          for metric in ("ttft", "tpot") for q in (50, 90, 99)),
        sa.Column("num_misses_by_reason", JSON, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_request_windows"),
        sa.UniqueConstraint("deployment", "window_start", "window_s",
                            name="uq_pdserve_request_windows_deployment_window_start_window_s"),
    )

    op.create_table(
        "pdserve_transfer_stats",
        _id(),
        sa.Column("ticket_id", sa.String(64), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("prefill_worker_id", sa.String(128), nullable=False),
        sa.Column("decode_worker_id", sa.String(128), nullable=False),
        sa.Column("num_blocks", sa.Integer(), nullable=False),
        sa.Column("num_bytes", sa.BigInteger(), nullable=False),
        sa.Column("transfer_s", sa.Double(), nullable=False),
        sa.Column("exposed_s", sa.Double(), nullable=False),
        sa.Column("prefill_compute_s", sa.Double(), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("at", UTC_TIME, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_transfer_stats"),
        sa.UniqueConstraint("ticket_id", "attempt",
                            name="uq_pdserve_transfer_stats_ticket_id_attempt"),
    )
    op.create_index("ix_pdserve_transfer_stats_deployment_at", "pdserve_transfer_stats",
                    ["deployment", "at"])

    op.create_table(
        "pdserve_expert_placements",
        _id(),
        sa.Column("deployment", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", UTC_TIME, nullable=False),
        sa.Column("placement", JSON, nullable=False),
        sa.Column("balancedness", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_pdserve_expert_placements"),
        sa.UniqueConstraint("deployment", "version",
                            name="uq_pdserve_expert_placements_deployment_version"),
    )


def downgrade() -> None:
    op.drop_table("pdserve_expert_placements")
    op.drop_index("ix_pdserve_transfer_stats_deployment_at", table_name="pdserve_transfer_stats")
    op.drop_table("pdserve_transfer_stats")
    op.drop_table("pdserve_request_windows")
    op.drop_index("ix_pdserve_scaling_decisions_deployment_at",
                  table_name="pdserve_scaling_decisions")
    op.drop_table("pdserve_scaling_decisions")
    op.drop_index("ix_pdserve_capacity_plans_deployment_created_at",
                  table_name="pdserve_capacity_plans")
    op.drop_table("pdserve_capacity_plans")
    op.drop_index("ix_pdserve_worker_events_worker_id_at", table_name="pdserve_worker_events")
    op.drop_index("ix_pdserve_worker_events_deployment_at", table_name="pdserve_worker_events")
    op.drop_table("pdserve_worker_events")
    op.drop_table("pdserve_deployments")
