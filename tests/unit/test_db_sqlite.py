"""The durable store on SQLite (the embedded default): migrations, schema, and every repository
round trip from ``pdserve.db.testing``, which the Postgres suite runs too; plus URL checks and
record validation, which need no database."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest
import sqlalchemy as sa

from pdserve.common.errors import ConfigError, InvalidArgumentError
from pdserve.common.types import TicketState, WorkerRole, WorkerState
from pdserve.db import (
    CapacityPlanRecord,
    Repository,
    RequestWindowRecord,
    WorkerEventRecord,
    check_at_head,
    current,
    head,
    make_engine,
    normalize_url,
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


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[sa.Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'pdserve.db'}")
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


def test_upgrade_by_url_creates_the_file_and_its_directory(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state' / 'nested' / 'pdserve.db'}"
    assert current(url) is None
    assert upgrade(url) == head()
    assert (tmp_path / "state" / "nested" / "pdserve.db").is_file()
    assert current(url) == head()


def test_a_revision_this_pdserve_does_not_ship_is_a_config_error(engine: sa.Engine) -> None:
    with pytest.raises(ConfigError, match="nonexistent"):
        upgrade(engine, "nonexistent")
    upgrade(engine)
    with engine.begin() as connection:  # as if a newer pdserve had migrated this database
        connection.execute(sa.text("UPDATE pdserve_alembic_version SET version_num = 'from-v9'"))
    with pytest.raises(ConfigError, match="from-v9"):
        upgrade(engine)
    with pytest.raises(ConfigError, match="pdserve db upgrade"):
        check_at_head(engine)


def test_in_memory_database_is_shared_across_threads_of_one_engine() -> None:
    repo = Repository.from_url("sqlite://", clock=contract.StepClock())
    try:
        upgrade(repo.engine)
        event = WorkerEventRecord("d-1", "llama", WorkerRole.DECODE, WorkerState.READY)
        stored = asyncio.run(asyncio.to_thread(repo.record_worker_event, event))
        assert repo.list_worker_events(worker_id="d-1") == [stored]
        contract.check_concurrent_writers(repo)
        assert current("sqlite://") is None  # another engine, another (empty) database
    finally:
        repo.close()


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgresql://u:pw@db.internal:5433/pdserve",
         "postgresql+psycopg://u:***@db.internal:5433/pdserve"),
        ("postgres://u@db/pdserve", "postgresql+psycopg://u@db/pdserve"),
        ("postgresql+psycopg://u@db/pdserve?sslmode=require",
         "postgresql+psycopg://u@db/pdserve?sslmode=require"),
        ("sqlite:///relative/pdserve.db", "sqlite:///relative/pdserve.db"),
        ("sqlite:////var/lib/pdserve.db", "sqlite:////var/lib/pdserve.db"),
        ("sqlite+pysqlite://", "sqlite://"),
    ],
)
def test_urls_are_normalised(given: str, expected: str) -> None:
    assert normalize_url(given).render_as_string(hide_password=True) == expected


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "not a url",
        "mysql://u:hunter2@db/pdserve",
        "postgresql+asyncpg://u:hunter2@db/pdserve",
        "postgresql://u:hunter2@db",
        "sqlite://u:hunter2@host/pdserve.db",
    ],
)
def test_bad_urls_name_the_setting_and_the_form_but_not_the_password(bad: str) -> None:
    with pytest.raises(ConfigError) as caught:
        normalize_url(bad)
    assert caught.value.field == "PDSERVE_DATABASE_URL"
    assert "PDSERVE_DATABASE_URL" in caught.value.message
    assert "postgresql+psycopg://user[:password]@host[:port]/dbname" in caught.value.message
    assert "sqlite:///" in caught.value.message
    assert "hunter2" not in caught.value.message


def test_upgrade_with_a_bad_url_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="PDSERVE_DATABASE_URL"):
        upgrade("redis://127.0.0.1:6379/0")


def test_records_refuse_naive_times_and_impossible_counts() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        WorkerEventRecord("p-0", "llama", WorkerRole.PREFILL, WorkerState.READY,
                          at=datetime(2025, 1, 1))
    assert caught.value.field == "at"
    window = {
        "deployment": "llama", "window_start": contract.EPOCH, "window_s": 10.0,
        "num_requests": 10, "num_ok": 8, "num_ttft_slo_misses": 2, "num_tpot_slo_misses": 0,
        "num_errors": 1, "goodput_rps": 0.6,
    }
    RequestWindowRecord(**window)  # type: ignore[arg-type]
    for field, value in (("num_errors", 3), ("num_tpot_slo_misses", 9), ("window_s", 0.0),
                         ("goodput_rps", math.inf)):
        with pytest.raises(InvalidArgumentError):
            RequestWindowRecord(**{**window, field: value})  # type: ignore[arg-type]


def test_records_refuse_json_that_postgres_would_refuse() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        CapacityPlanRecord("llama", 1, 1, 100.0, 20.0, 0, inputs={"rps": math.nan})
    assert caught.value.field == "inputs"
    with pytest.raises(InvalidArgumentError):
        CapacityPlanRecord("llama", 1, 1, 100.0, 20.0, 0, inputs={"at": contract.EPOCH})


def test_transfer_outcome_must_be_terminal() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        contract.sample_transfer("t-1", outcome=TicketState.TRANSFERRING)
    assert caught.value.field == "outcome"


def test_limits_are_checked(repo: Repository) -> None:
    for limit in (0, 10_001):
        with pytest.raises(InvalidArgumentError):
            repo.list_scaling_decisions("llama", limit)


def test_a_naive_clock_is_refused(engine: sa.Engine) -> None:
    upgrade(engine)
    repo = Repository(engine, clock=lambda: datetime(2025, 1, 1))
    with pytest.raises(ValueError, match="aware"):
        repo.record_worker_event(
            WorkerEventRecord("p-0", "llama", WorkerRole.PREFILL, WorkerState.READY))
