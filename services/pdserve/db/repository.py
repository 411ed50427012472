"""The durable store's API for services: records in, records out, no ORM types cross it.

Methods are synchronous and thread-safe (each call is one short transaction on a pooled
connection); asyncio services call them with ``await asyncio.to_thread(repo.method, ...)``.
Lists are newest first. Errors are ``pdserve.common.errors`` types:

- ``UnavailableError``: the database cannot be reached or dropped the connection (retry later);
- ``ConfigError``: the schema is missing or behind (run ``pdserve db upgrade``);
- ``AlreadyExistsError``: an explicit expert-placement version that is taken;
- ``InvalidArgumentError``: a bad ``limit`` (records check their own fields).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from pdserve.common.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidArgumentError,
    UnavailableError,
)
from pdserve.common.types import ThresholdSource, TicketState, WorkerRole, WorkerState
from pdserve.db.engine import SETTING, is_sqlite_memory, make_engine
from pdserve.db.models import (
    CapacityPlan,
    Deployment,
    ExpertPlacement,
    RequestWindow,
    ScalingDecision,
    ThresholdDecision,
    TransferStats,
    WorkerEvent,
)
from pdserve.db.records import (
    CapacityPlanRecord,
    DeploymentRecord,
    ExpertPlacementRecord,
    RequestWindowRecord,
    ScalingAction,
    ScalingDecisionRecord,
    ThresholdDecisionRecord,
    TransferStatsRecord,
    WorkerEventRecord,
)

logger = logging.getLogger(__name__)

WallClock = Callable[[], datetime]
"""Returns the current time as an aware datetime. Injected so tests control time."""

MAX_LIMIT = 10_000
_TRANSFER_CHUNK_ROWS = 500  # 12 parameters a row stays far below every driver's limit
_MISSING_SCHEMA_SQLSTATES = frozenset({"42P01", "42703"})  # undefined table / column


def utc_now() -> datetime:
    return datetime.now(UTC)


def _utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


def _check_limit(limit: int) -> None:
    if not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgumentError(f"limit must be an integer in [1, {MAX_LIMIT}]", field="limit")


def _first_line(error: BaseException | None) -> str:
    return str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""


def _is_missing_schema(error: DBAPIError) -> bool:
    if getattr(error.orig, "sqlstate", None) in _MISSING_SCHEMA_SQLSTATES:
        return True
    return _first_line(error.orig).startswith(("no such table", "no such column"))


class Repository:
    """Durable records of one pdserve installation, over one SQLAlchemy engine.

    ``clock`` stamps records whose time is None. The schema must be at head (see
    ``pdserve.db.migrate.upgrade``); the repository never creates tables itself.
    """

    def __init__(self, engine: Engine, *, clock: WallClock = utc_now) -> None:
        self._engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._clock = clock
        # In-memory SQLite is one connection shared by every thread: one transaction at a time.
        is_shared = is_sqlite_memory(engine.url)
        self._serial: AbstractContextManager[Any] = threading.Lock() if is_shared else nullcontext()
        table = TransferStats.__table__
        self._transfer_insert = (
            self._insert(table)
            .on_conflict_do_nothing(index_elements=["ticket_id", "attempt"])
            .returning(table.c.id)
        )

    @classmethod
    def from_url(cls, url: str | URL, *, clock: WallClock = utc_now) -> Repository:
        """A repository on a new engine for ``url`` (checked as ``PDSERVE_DATABASE_URL``)."""
        return cls(make_engine(url), clock=clock)

    @property
    def engine(self) -> Engine:
        return self._engine

    def close(self) -> None:
        """Close pooled connections. An in-memory SQLite database is gone afterwards."""
        self._engine.dispose()

    def _now(self) -> datetime:
        now = self._clock()
        if now.utcoffset() is None:
            raise ValueError("the repository clock must return aware datetimes")
        return _utc(now)

    @contextmanager
    def _transaction(self) -> Iterator[Session]:
        try:
            with self._serial, self._sessions.begin() as session:
                yield session
        except IntegrityError as exc:
            raise AlreadyExistsError(f"record exists already: {_first_line(exc.orig)}") from exc
        except DBAPIError as exc:
            if _is_missing_schema(exc):
                raise ConfigError(
                    f"database schema missing or behind ({_first_line(exc.orig)}): "
                    "run `pdserve db upgrade`",
                    field=SETTING,
                ) from exc
            if isinstance(exc, (OperationalError, InterfaceError)):
                logger.warning("database call failed: %s", _first_line(exc.orig))
                raise UnavailableError(f"database unavailable: {_first_line(exc.orig)}") from exc
            raise

    def _insert(self, table: Any) -> Any:
        """INSERT with ON CONFLICT support for the engine's dialect."""
        if self._engine.dialect.name == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    # Deployments ---------------------------------------------------------------------------

    def upsert_deployment(self, record: DeploymentRecord) -> DeploymentRecord:
        """Create the deployment or update it by name; ``created_at`` of an existing one stays."""
        now = self._now()
        values = {
            "name": record.name,
            "model": record.model,
            "gpu": record.gpu,
            "tp_size": record.tp_size,
            "config": dict(record.config),
            "created_at": _utc(record.created_at) if record.created_at else now,
            "updated_at": _utc(record.updated_at) if record.updated_at else now,
        }
        insert = self._insert(Deployment).values(values)
        updated = ("model", "gpu", "tp_size", "config", "updated_at")
        statement = insert.on_conflict_do_update(
            index_elements=[Deployment.name],
            set_={name: insert.excluded[name] for name in updated},
        )
        with self._transaction() as session:
            session.execute(statement)
            row = session.scalars(sa.select(Deployment).filter_by(name=record.name)).one()
            return _deployment_record(row)

    def get_deployment(self, name: str) -> DeploymentRecord | None:
        with self._transaction() as session:
            row = session.scalars(sa.select(Deployment).filter_by(name=name)).one_or_none()
            return _deployment_record(row) if row is not None else None

    def list_deployments(self) -> list[DeploymentRecord]:
        """Every deployment, by name."""
        with self._transaction() as session:
            rows = session.scalars(sa.select(Deployment).order_by(Deployment.name))
            return [_deployment_record(row) for row in rows]

    # Worker lifecycle ----------------------------------------------------------------------

    def record_worker_event(self, record: WorkerEventRecord, *,
                            skip_if_recorded: bool = False) -> WorkerEventRecord:
        """Store the event. ``skip_if_recorded`` (with ``at`` set) makes the write idempotent:
        an event of the same worker, state, reason and time already stored is not added again
        (a durable spool replays records whose first write it could not confirm)."""
        row = WorkerEvent(
            worker_id=record.worker_id,
            deployment=record.deployment,
            role=record.role.value,
            from_state=record.from_state.value if record.from_state is not None else None,
            to_state=record.to_state.value,
            reason=record.reason,
            at=_utc(record.at) if record.at else self._now(),
        )
        with self._transaction() as session:
            if skip_if_recorded and record.at is not None and session.scalar(
                sa.select(WorkerEvent.id).filter_by(
                    worker_id=row.worker_id, deployment=row.deployment, role=row.role,
                    to_state=row.to_state, reason=row.reason, at=row.at,
                ).limit(1)
            ) is not None:
                return _worker_event_record(row)
            session.add(row)
        return _worker_event_record(row)

    def list_worker_events(
        self, *, deployment: str | None = None, worker_id: str | None = None, limit: int = 100
    ) -> list[WorkerEventRecord]:
        """The latest ``limit`` events, of one deployment and/or one worker if given."""
        _check_limit(limit)
        query = sa.select(WorkerEvent)
        if deployment is not None:
            query = query.filter_by(deployment=deployment)
        if worker_id is not None:
            query = query.filter_by(worker_id=worker_id)
        query = query.order_by(WorkerEvent.at.desc(), WorkerEvent.id.desc()).limit(limit)
        with self._transaction() as session:
            return [_worker_event_record(row) for row in session.scalars(query)]

    # Autoscaling and planning --------------------------------------------------------------

    def record_scaling_decision(self, record: ScalingDecisionRecord, *,
                                skip_if_recorded: bool = False) -> ScalingDecisionRecord:
        """Store the decision; ``skip_if_recorded`` (with ``at`` set): not again if a decision
        of the same pool, action and time is stored (idempotent replays)."""
        row = ScalingDecision(
            deployment=record.deployment,
            role=record.role.value,
            at=_utc(record.at) if record.at else self._now(),
            num_current_instances=record.num_current_instances,
            num_target_instances=record.num_target_instances,
            action=record.action.value,
            reason=record.reason,
            is_dry_run=record.is_dry_run,
            inputs=dict(record.inputs),
            forecast=dict(record.forecast),
        )
        with self._transaction() as session:
            if skip_if_recorded and record.at is not None and session.scalar(
                sa.select(ScalingDecision.id).filter_by(
                    deployment=row.deployment, role=row.role, action=row.action, at=row.at,
                ).limit(1)
            ) is not None:
                return _scaling_decision_record(row)
            session.add(row)
        return _scaling_decision_record(row)

    def list_scaling_decisions(
        self, deployment: str, limit: int = 100, *, role: WorkerRole | None = None
    ) -> list[ScalingDecisionRecord]:
        """The latest ``limit`` decisions for ``deployment`` (one pool if ``role`` is given)."""
        _check_limit(limit)
        query = sa.select(ScalingDecision).filter_by(deployment=deployment)
        if role is not None:
            query = query.filter_by(role=role.value)
        query = query.order_by(ScalingDecision.at.desc(), ScalingDecision.id.desc()).limit(limit)
        with self._transaction() as session:
            return [_scaling_decision_record(row) for row in session.scalars(query)]

    def record_threshold_decision(self, record: ThresholdDecisionRecord) -> ThresholdDecisionRecord:
        row = ThresholdDecision(
            deployment=record.deployment,
            at=_utc(record.at) if record.at else self._now(),
            threshold_tokens=record.threshold_tokens,
            source=record.source.value,
            computed_tokens=record.computed_tokens,
            reason=record.reason,
            is_published=record.is_published,
            version=record.version,
            inputs=dict(record.inputs),
        )
        with self._transaction() as session:
            session.add(row)
        return _threshold_decision_record(row)

    def list_threshold_decisions(self, deployment: str,
                                 limit: int = 100) -> list[ThresholdDecisionRecord]:
        """The latest ``limit`` threshold decisions for ``deployment``, newest first."""
        _check_limit(limit)
        query = (sa.select(ThresholdDecision).filter_by(deployment=deployment)
                 .order_by(ThresholdDecision.at.desc(), ThresholdDecision.id.desc()).limit(limit))
        with self._transaction() as session:
            return [_threshold_decision_record(row) for row in session.scalars(query)]

    def record_capacity_plan(self, record: CapacityPlanRecord) -> CapacityPlanRecord:
        row = CapacityPlan(
            deployment=record.deployment,
            created_at=_utc(record.created_at) if record.created_at else self._now(),
            num_prefill_instances=record.num_prefill_instances,
            num_decode_instances=record.num_decode_instances,
            predicted_ttft_ms=record.predicted_ttft_ms,
            predicted_tpot_ms=record.predicted_tpot_ms,
            local_prefill_threshold_tokens=record.local_prefill_threshold_tokens,
            inputs=dict(record.inputs),
            outputs=dict(record.outputs),
        )
        with self._transaction() as session:
            session.add(row)
        return _capacity_plan_record(row)

    def latest_capacity_plan(self, deployment: str) -> CapacityPlanRecord | None:
        query = (
            sa.select(CapacityPlan)
            .filter_by(deployment=deployment)
            .order_by(CapacityPlan.created_at.desc(), CapacityPlan.id.desc())
            .limit(1)
        )
        with self._transaction() as session:
            row = session.scalars(query).one_or_none()
            return _capacity_plan_record(row) if row is not None else None

    # Request outcomes and transfers --------------------------------------------------------

    def record_request_window(self, record: RequestWindowRecord) -> RequestWindowRecord:
        """Store the window, replacing one with the same (deployment, window_start, window_s,
        source)."""
        values = {
            "deployment": record.deployment,
            "window_start": _utc(record.window_start),
            "window_s": float(record.window_s),
            "num_requests": record.num_requests,
            "num_ok": record.num_ok,
            "num_ttft_slo_misses": record.num_ttft_slo_misses,
            "num_tpot_slo_misses": record.num_tpot_slo_misses,
            "num_errors": record.num_errors,
            "goodput_rps": float(record.goodput_rps),
            **{name: getattr(record, name) for name in _PERCENTILE_COLUMNS},
            "num_misses_by_reason": dict(record.num_misses_by_reason),
            "source": record.source,
        }
        insert = self._insert(RequestWindow).values(values)
        key = ("deployment", "window_start", "window_s", "source")
        statement = insert.on_conflict_do_update(
            index_elements=[RequestWindow.__table__.c[name] for name in key],
            set_={name: insert.excluded[name] for name in values if name not in key},
        )
        with self._transaction() as session:
            session.execute(statement)
        return _request_window_record(values)

    def list_request_windows(
        self, deployment: str, *, since: datetime | None = None, limit: int = 1000
    ) -> list[RequestWindowRecord]:
        """The latest ``limit`` windows of ``deployment`` starting at or after ``since``."""
        _check_limit(limit)
        query = sa.select(RequestWindow).filter_by(deployment=deployment)
        if since is not None:
            if since.utcoffset() is None:
                raise InvalidArgumentError("since must be a timezone-aware datetime",
                                           field="since")
            query = query.where(RequestWindow.window_start >= since)
        query = query.order_by(RequestWindow.window_start.desc(), RequestWindow.id.desc())
        with self._transaction() as session:
            rows = session.scalars(query.limit(limit))
            return [_request_window_record(_columns(row)) for row in rows]

    def record_transfer_stats(self, batch: Iterable[TransferStatsRecord]) -> int:
        """Store a batch; returns how many were new. A (ticket_id, attempt) already stored, or
        repeated in the batch, is skipped, so a retried batch is harmless."""
        now = self._now()
        rows_by_token: dict[tuple[str, int], dict[str, Any]] = {}
        for record in batch:
            rows_by_token.setdefault((record.ticket_id, record.attempt), {
                "ticket_id": record.ticket_id,
                "attempt": record.attempt,
                "deployment": record.deployment,
                "prefill_worker_id": record.prefill_worker_id,
                "decode_worker_id": record.decode_worker_id,
                "num_blocks": record.num_blocks,
                "num_bytes": record.num_bytes,
                "transfer_s": float(record.transfer_s),
                "exposed_s": float(record.exposed_s),
                "prefill_compute_s": float(record.prefill_compute_s),
                "outcome": record.outcome.value,
                "at": _utc(record.at) if record.at else now,
            })
        rows = list(rows_by_token.values())
        if not rows:
            return 0
        num_new = 0
        with self._transaction() as session:
            for start in range(0, len(rows), _TRANSFER_CHUNK_ROWS):
                # One statement for every batch, its rows as parameters (SQLAlchemy sends them
                # as one multi-row INSERT): compiled once, not per batch size, and on the table,
                # not through the ORM's bulk path. 1.3 ms of CPU for a one-row batch before.
                result = session.execute(self._transfer_insert,
                                         rows[start:start + _TRANSFER_CHUNK_ROWS])
                num_new += len(result.all())
        return num_new

    def list_transfer_stats(self, deployment: str, limit: int = 1000) -> list[TransferStatsRecord]:
        _check_limit(limit)
        query = (
            sa.select(TransferStats)
            .filter_by(deployment=deployment)
            .order_by(TransferStats.at.desc(), TransferStats.id.desc())
            .limit(limit)
        )
        with self._transaction() as session:
            return [_transfer_stats_record(row) for row in session.scalars(query)]

    # Expert placement ----------------------------------------------------------------------

    def record_expert_placement(self, record: ExpertPlacementRecord) -> ExpertPlacementRecord:
        """Store a placement; a None ``version`` becomes the deployment's latest plus one.
        Raises ``AlreadyExistsError`` if the version is taken (e.g. by a concurrent writer)."""
        created_at = _utc(record.created_at) if record.created_at else self._now()
        with self._transaction() as session:
            version = record.version
            if version is None:
                latest = session.scalar(
                    sa.select(sa.func.max(ExpertPlacement.version))
                    .filter_by(deployment=record.deployment)
                )
                version = (latest or 0) + 1
            row = ExpertPlacement(
                deployment=record.deployment,
                version=version,
                created_at=created_at,
                placement=dict(record.placement),
                balancedness=float(record.balancedness),
            )
            session.add(row)
        return _expert_placement_record(row)

    def latest_expert_placement(self, deployment: str) -> ExpertPlacementRecord | None:
        """The placement with the highest version for ``deployment``."""
        query = (
            sa.select(ExpertPlacement)
            .filter_by(deployment=deployment)
            .order_by(ExpertPlacement.version.desc())
            .limit(1)
        )
        with self._transaction() as session:
            row = session.scalars(query).one_or_none()
            return _expert_placement_record(row) if row is not None else None


# ORM rows -> records -----------------------------------------------------------------------

_PERCENTILE_COLUMNS = tuple(
    f"{metric}_p{q}_ms" for metric in ("ttft", "tpot") for q in (50, 90, 99)
)


def _columns(row: RequestWindow) -> dict[str, Any]:
    return {column.key: getattr(row, column.key) for column in RequestWindow.__table__.columns}


def _deployment_record(row: Deployment) -> DeploymentRecord:
    return DeploymentRecord(
        name=row.name,
        model=row.model,
        gpu=row.gpu,
        tp_size=row.tp_size,
        config=row.config,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def _worker_event_record(row: WorkerEvent) -> WorkerEventRecord:
    return WorkerEventRecord(
        worker_id=row.worker_id,
        deployment=row.deployment,
        role=WorkerRole(row.role),
        to_state=WorkerState(row.to_state),
        from_state=WorkerState(row.from_state) if row.from_state is not None else None,
        reason=row.reason,
        at=row.at,
    )


def _scaling_decision_record(row: ScalingDecision) -> ScalingDecisionRecord:
    return ScalingDecisionRecord(
        deployment=row.deployment,
        role=WorkerRole(row.role),
        num_current_instances=row.num_current_instances,
        num_target_instances=row.num_target_instances,
        action=ScalingAction(row.action),
        reason=row.reason,
        is_dry_run=row.is_dry_run,
        inputs=row.inputs,
        forecast=row.forecast,
        at=row.at,
    )


def _threshold_decision_record(row: ThresholdDecision) -> ThresholdDecisionRecord:
    return ThresholdDecisionRecord(
        deployment=row.deployment,
        threshold_tokens=row.threshold_tokens,
        source=ThresholdSource(row.source),
        reason=row.reason,
        computed_tokens=row.computed_tokens,
        is_published=row.is_published,
        version=row.version,
        inputs=row.inputs,
        at=row.at,
    )


def _capacity_plan_record(row: CapacityPlan) -> CapacityPlanRecord:
    return CapacityPlanRecord(
        deployment=row.deployment,
        num_prefill_instances=row.num_prefill_instances,
        num_decode_instances=row.num_decode_instances,
        predicted_ttft_ms=row.predicted_ttft_ms,
        predicted_tpot_ms=row.predicted_tpot_ms,
        local_prefill_threshold_tokens=row.local_prefill_threshold_tokens,
        inputs=row.inputs,
        outputs=row.outputs,
        created_at=row.created_at,
    )


def _request_window_record(values: dict[str, Any]) -> RequestWindowRecord:
    fields = RequestWindowRecord.__dataclass_fields__
    return RequestWindowRecord(**{name: values[name] for name in fields})


def _transfer_stats_record(row: TransferStats) -> TransferStatsRecord:
    return TransferStatsRecord(
        ticket_id=row.ticket_id,
        attempt=row.attempt,
        deployment=row.deployment,
        prefill_worker_id=row.prefill_worker_id,
        decode_worker_id=row.decode_worker_id,
        num_blocks=row.num_blocks,
        num_bytes=row.num_bytes,
        transfer_s=row.transfer_s,
        exposed_s=row.exposed_s,
        prefill_compute_s=row.prefill_compute_s,
        outcome=TicketState(row.outcome),
        at=row.at,
    )


def _expert_placement_record(row: ExpertPlacement) -> ExpertPlacementRecord:
    return ExpertPlacementRecord(
        deployment=row.deployment,
        placement=row.placement,
        balancedness=row.balancedness,
        version=row.version,
        created_at=row.created_at,
    )

