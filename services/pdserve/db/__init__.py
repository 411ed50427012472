"""Durable state of pdserve: deployments and the history of its decisions and outcomes.

Postgres (``postgresql+psycopg://...``) for a fleet, SQLite (``sqlite:///path.db``) for the
embedded one-machine default; see ``pdserve.db.engine`` for the accepted URLs. The schema is
managed by Alembic revisions shipped inside this package (``pdserve/db/migrations``).

``pdserve db upgrade`` is one call::

    from pdserve.db import upgrade
    revision = upgrade(settings.database_url)        # PDSERVE_DATABASE_URL; "head" by default

A bad URL raises ``pdserve.common.errors.ConfigError`` naming ``PDSERVE_DATABASE_URL`` and the
expected form. Services then write and read records through ``Repository``, from asyncio with
``asyncio.to_thread``::

    repo = Repository.from_url(settings.database_url)
    check_at_head(repo.engine)                       # refuse to start on an old schema
    await asyncio.to_thread(repo.record_scaling_decision, ScalingDecisionRecord(...))

For an in-memory SQLite database (``sqlite://``) migrate the repository's own engine,
``upgrade(repo.engine)``: each engine has its own in-memory database.
"""

from pdserve.db.engine import make_engine, normalize_url
from pdserve.db.migrate import check_at_head, current, downgrade, head, schema_diff, upgrade
from pdserve.db.records import (
    CapacityPlanRecord,
    DeploymentRecord,
    ExpertPlacementRecord,
    MissReason,
    RequestWindowRecord,
    ScalingAction,
    ScalingDecisionRecord,
    ThresholdDecisionRecord,
    TransferStatsRecord,
    WorkerEventRecord,
)
from pdserve.db.repository import Repository, WallClock, utc_now

__all__ = [
    "CapacityPlanRecord",
    "DeploymentRecord",
    "ExpertPlacementRecord",
    "MissReason",
    "Repository",
    "RequestWindowRecord",
    "ScalingAction",
    "ScalingDecisionRecord",
    "ThresholdDecisionRecord",
    "TransferStatsRecord",
    "WallClock",
    "WorkerEventRecord",
    "check_at_head",
    "current",
    "downgrade",
    "head",
    "make_engine",
    "normalize_url",
    "schema_diff",
    "upgrade",
    "utc_now",
]
