"""ORM tables of the durable store. Only ``pdserve.db`` imports these; services use records.

Every table is ``pdserve_<plural noun>`` so pdserve can share a database with other applications.
Records name their deployment by ``deployment`` (the deployment's name) without a foreign key on
purpose: these tables are an append-only history, which must accept a worker event or a decision
before anyone has upserted the deployment row, and must outlive a deleted deployment.

Times are ``TIMESTAMP WITH TIME ZONE`` on Postgres; SQLite has no zone, so ``UtcDateTime`` stores
UTC there and hands back aware UTC datetimes on both. JSON is JSONB on Postgres, JSON on SQLite.

A change here needs a new revision in ``migrations/versions`` written to match;
``pdserve.db.migrate.schema_diff`` (run by the tests on both databases) says what differs.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Constraint and index names, so that every database and every revision agrees on them."""

Json = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
"""JSONB on Postgres (indexable, compact), JSON text on SQLite."""

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
"""64-bit surrogate key; INTEGER on SQLite so it is the auto-incrementing rowid."""


class UtcDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware datetime stored as UTC. Naive datetimes are refused, never guessed."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r}: pdserve stores aware UTC times only")
        utc = value.astimezone(UTC)
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class Deployment(Base):
    __tablename__ = "pdserve_deployments"

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(128), unique=True)
    model: Mapped[str] = mapped_column(sa.String(256))
    gpu: Mapped[str] = mapped_column(sa.String(64))
    tp_size: Mapped[int] = mapped_column(sa.Integer)
    config: Mapped[dict[str, Any]] = mapped_column(Json)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class WorkerEvent(Base):
    __tablename__ = "pdserve_worker_events"
    __table_args__ = (
        sa.Index(None, "deployment", "at"),
        sa.Index(None, "worker_id", "at"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    worker_id: Mapped[str] = mapped_column(sa.String(128))
    deployment: Mapped[str] = mapped_column(sa.String(128))
    role: Mapped[str] = mapped_column(sa.String(16))
    from_state: Mapped[str | None] = mapped_column(sa.String(16))
    to_state: Mapped[str] = mapped_column(sa.String(16))
    reason: Mapped[str] = mapped_column(sa.Text)
    at: Mapped[datetime] = mapped_column(UtcDateTime)


class CapacityPlan(Base):
    __tablename__ = "pdserve_capacity_plans"
    __table_args__ = (sa.Index(None, "deployment", "created_at"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    deployment: Mapped[str] = mapped_column(sa.String(128))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    num_prefill_instances: Mapped[int] = mapped_column(sa.Integer)
    num_decode_instances: Mapped[int] = mapped_column(sa.Integer)
    predicted_ttft_ms: Mapped[float] = mapped_column(sa.Double)
    predicted_tpot_ms: Mapped[float] = mapped_column(sa.Double)
    local_prefill_threshold_tokens: Mapped[int] = mapped_column(sa.Integer)
    inputs: Mapped[dict[str, Any]] = mapped_column(Json)
    outputs: Mapped[dict[str, Any]] = mapped_column(Json)


class ScalingDecision(Base):
    __tablename__ = "pdserve_scaling_decisions"
    __table_args__ = (sa.Index(None, "deployment", "at"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    deployment: Mapped[str] = mapped_column(sa.String(128))
    role: Mapped[str] = mapped_column(sa.String(16))
    at: Mapped[datetime] = mapped_column(UtcDateTime)
    num_current_instances: Mapped[int] = mapped_column(sa.Integer)
    num_target_instances: Mapped[int] = mapped_column(sa.Integer)
    action: Mapped[str] = mapped_column(sa.String(16))
    reason: Mapped[str] = mapped_column(sa.Text)
    is_dry_run: Mapped[bool] = mapped_column(sa.Boolean)
    inputs: Mapped[dict[str, Any]] = mapped_column(Json)
    forecast: Mapped[dict[str, Any]] = mapped_column(Json)


class ThresholdDecision(Base):
    __tablename__ = "pdserve_threshold_decisions"
    __table_args__ = (sa.Index(None, "deployment", "at"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    deployment: Mapped[str] = mapped_column(sa.String(128))
    at: Mapped[datetime] = mapped_column(UtcDateTime)
    threshold_tokens: Mapped[int] = mapped_column(sa.Integer)
    source: Mapped[str] = mapped_column(sa.String(16))
    computed_tokens: Mapped[int | None] = mapped_column(sa.Integer)
    reason: Mapped[str] = mapped_column(sa.Text)
    is_published: Mapped[bool] = mapped_column(sa.Boolean)
    version: Mapped[int | None] = mapped_column(sa.Integer)
    inputs: Mapped[dict[str, Any]] = mapped_column(Json)


class RequestWindow(Base):
    __tablename__ = "pdserve_request_windows"
    __table_args__ = (sa.UniqueConstraint("deployment", "window_start", "window_s", "source",
                                        name="uq_pdserve_request_windows_window_source"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    deployment: Mapped[str] = mapped_column(sa.String(128))
    window_start: Mapped[datetime] = mapped_column(UtcDateTime)
    window_s: Mapped[float] = mapped_column(sa.Double)
    num_requests: Mapped[int] = mapped_column(sa.Integer)
    num_ok: Mapped[int] = mapped_column(sa.Integer)
    num_ttft_slo_misses: Mapped[int] = mapped_column(sa.Integer)
    num_tpot_slo_misses: Mapped[int] = mapped_column(sa.Integer)
    num_errors: Mapped[int] = mapped_column(sa.Integer)
    goodput_rps: Mapped[float] = mapped_column(sa.Double)
    ttft_p50_ms: Mapped[float | None] = mapped_column(sa.Double)
    ttft_p90_ms: Mapped[float | None] = mapped_column(sa.Double)
    ttft_p99_ms: Mapped[float | None] = mapped_column(sa.Double)
    tpot_p50_ms: Mapped[float | None] = mapped_column(sa.Double)
    tpot_p90_ms: Mapped[float | None] = mapped_column(sa.Double)
    tpot_p99_ms: Mapped[float | None] = mapped_column(sa.Double)
    num_misses_by_reason: Mapped[dict[str, Any]] = mapped_column(Json)
    source: Mapped[str] = mapped_column(sa.String(128), server_default="")
    """The router replica that counted these requests (windows of replicas add up)."""


class TransferStats(Base):
    __tablename__ = "pdserve_transfer_stats"
    __table_args__ = (
        sa.UniqueConstraint("ticket_id", "attempt"),
        sa.Index(None, "deployment", "at"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    ticket_id: Mapped[str] = mapped_column(sa.String(64))
    attempt: Mapped[int] = mapped_column(sa.Integer)
    deployment: Mapped[str] = mapped_column(sa.String(128))
    prefill_worker_id: Mapped[str] = mapped_column(sa.String(128))
    decode_worker_id: Mapped[str] = mapped_column(sa.String(128))
    num_blocks: Mapped[int] = mapped_column(sa.Integer)
    num_bytes: Mapped[int] = mapped_column(sa.BigInteger)
    transfer_s: Mapped[float] = mapped_column(sa.Double)
    exposed_s: Mapped[float] = mapped_column(sa.Double)
    prefill_compute_s: Mapped[float] = mapped_column(sa.Double)
    outcome: Mapped[str] = mapped_column(sa.String(16))
    at: Mapped[datetime] = mapped_column(UtcDateTime)


class ExpertPlacement(Base):
    __tablename__ = "pdserve_expert_placements"
    __table_args__ = (sa.UniqueConstraint("deployment", "version"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True)
    deployment: Mapped[str] = mapped_column(sa.String(128))
    version: Mapped[int] = mapped_column(sa.Integer)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    placement: Mapped[dict[str, Any]] = mapped_column(Json)
    balancedness: Mapped[float] = mapped_column(sa.Double)
