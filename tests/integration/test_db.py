"""The durable store on real Postgres (psycopg 3): the same migration, schema and round-trip
checks as the SQLite suite (``pdserve.db.testing``), plus what only Postgres has: JSONB and
TIMESTAMPTZ columns, and the lock that makes replicas starting together migrate in turn.

Each test gets a freshly created schema, private to this session (``pdserve_test_<random>``, set
as the connection's search_path), so runs never collide with each other or with other data in
the database; the schema is dropped at the end.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL

from pdserve.common.errors import UnavailableError
from pdserve.common.types import WorkerRole, WorkerState
from pdserve.db import (
    Repository,
    WorkerEventRecord,
    current,
    head,
    make_engine,
    migrate,
    normalize_url,
    schema_diff,
    upgrade,
)
from pdserve.db import testing as contract

ROUND_TRIPS: list[Callable[[Repository], None]] = [
    contract.check_deployments,
    contract.check_worker_events,
    contract.check_scaling_decisions,
    contract.check_threshold_decisions,
    contract.check_capacity_plans,
    contract.check_request_windows,
    contract.check_transfer_stats,
    contract.check_expert_placements,
    contract.check_times_are_utc,
    contract.check_concurrent_writers,
]


@pytest.fixture(scope="session")
def admin_engine(database_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def schema_name(admin_engine: sa.Engine) -> Iterator[str]:
    name = f"pdserve_test_{secrets.token_hex(6)}"
    yield name
    with admin_engine.begin() as connection:
        connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))


@pytest.fixture
def schema_url(database_url: str, admin_engine: sa.Engine, schema_name: str) -> URL:
    """A URL whose connections see only a new, empty schema."""
    with admin_engine.begin() as connection:
        connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema_name}" CASCADE'))
        connection.execute(sa.text(f'CREATE SCHEMA "{schema_name}"'))
    return normalize_url(database_url).update_query_dict(
        {"options": f"-csearch_path={schema_name}"}
    )


@pytest.fixture
def engine(schema_url: URL) -> Iterator[sa.Engine]:
    engine = make_engine(schema_url)
    yield engine
    engine.dispose()


@pytest.fixture
def repo(engine: sa.Engine) -> Repository:
    upgrade(engine)
    return Repository(engine, clock=contract.StepClock())


def test_migration_cycle(engine: sa.Engine) -> None:
    contract.check_migration_cycle(engine)


def test_schema_matches_models(engine: sa.Engine) -> None:
    contract.check_schema_matches_models(engine)


def test_unmigrated_database_is_refused(engine: sa.Engine) -> None:
    contract.check_old_schema_is_refused(engine)


@pytest.mark.parametrize("check", ROUND_TRIPS, ids=lambda check: check.__name__)
def test_round_trip(repo: Repository, check: Callable[[Repository], None]) -> None:
    check(repo)


def test_upgrade_accepts_a_plain_postgresql_url(schema_url: URL) -> None:
    plain = schema_url.set(drivername="postgresql").render_as_string(hide_password=False)
    assert plain.startswith("postgresql://")
    assert current(plain) is None
    assert upgrade(plain) == head()
    assert current(plain) == head()


def test_json_is_jsonb_and_times_keep_their_zone(engine: sa.Engine) -> None:
    upgrade(engine)
    columns = {c["name"]: c["type"] for c in sa.inspect(engine).get_columns(
        "pdserve_scaling_decisions")}
    assert isinstance(columns["inputs"], postgresql.JSONB)
    assert isinstance(columns["forecast"], postgresql.JSONB)
    assert isinstance(columns["at"], sa.TIMESTAMP) and columns["at"].timezone is True


def _num_waiting_for_migration_lock(admin_engine: sa.Engine) -> int:
    query = sa.text(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid = 0 AND objid = :key AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    with admin_engine.connect() as connection:
        return int(connection.execute(query, {"key": migrate.MIGRATION_LOCK_KEY}).scalar_one())


def test_an_upgrade_waits_for_the_migration_lock(
    engine: sa.Engine, admin_engine: sa.Engine
) -> None:
    """What keeps replicas that start together from migrating over each other."""
    with engine.connect() as holder, ThreadPoolExecutor(max_workers=1) as pool:
        holder.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"),
                       {"key": migrate.MIGRATION_LOCK_KEY})
        upgrading = pool.submit(upgrade, engine)
        for _ in range(600):
            if _num_waiting_for_migration_lock(admin_engine) or upgrading.done():
                break
            time.sleep(0.05)
        assert _num_waiting_for_migration_lock(admin_engine) >= 1
        assert not upgrading.done()
        assert current(engine) is None
        holder.rollback()  # releases the lock
        assert upgrading.result(timeout=120) == head()
    assert schema_diff(engine) == []


def test_concurrent_upgrades_all_reach_head(schema_url: URL) -> None:
    engines = [make_engine(schema_url) for _ in range(3)]
    try:
        with ThreadPoolExecutor(max_workers=len(engines)) as pool:
            revisions = list(pool.map(upgrade, engines))
        assert revisions == [head()] * len(engines)
        assert schema_diff(engines[0]) == []
    finally:
        for engine in engines:
            engine.dispose()


def test_an_unreachable_database_is_unavailable() -> None:
    url = "postgresql://nobody@127.0.0.1:1/pdserve?connect_timeout=2"
    with pytest.raises(UnavailableError, match="database unavailable"):
        upgrade(url)
    repo = Repository.from_url(url)
    try:
        with pytest.raises(UnavailableError, match="database unavailable"):
            repo.record_worker_event(
                WorkerEventRecord("p-0", "llama", WorkerRole.PREFILL, WorkerState.READY))
    finally:
        repo.close()
