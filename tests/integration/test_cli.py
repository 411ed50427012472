"""The command line as an operator uses it: help, schema upgrades on Postgres and SQLite, and a
malformed setting stopping start-up with one line."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from pdserve.cli.main import COMMANDS


def _pdserve(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=timeout)


def test_help_lists_every_command() -> None:
    result = _pdserve("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert name in result.stdout


def test_db_upgrade_on_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'pd.db'}"
    result = _pdserve("db", "upgrade", env={"PDSERVE_DATABASE_URL": url})
    assert result.returncode == 0, result.stderr
    assert "revision" in result.stdout
    with sa.create_engine(url).connect() as connection:
        tables = set(sa.inspect(connection).get_table_names())
    assert {"pdserve_worker_events", "pdserve_scaling_decisions"} <= tables
    current = _pdserve("db", "current", "--database-url", url)
    assert current.returncode == 0 and current.stdout.strip() not in ("", "empty (no revision)")


def test_db_upgrade_on_postgres(database_url: str) -> None:
    schema = f"pdserve_cli_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(database_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        separator = "&" if "?" in database_url else "?"
        url = f"{database_url}{separator}options=-csearch_path%3D{schema}"
        result = _pdserve("db", "upgrade", env={"PDSERVE_DATABASE_URL": url})
        assert result.returncode == 0, result.stderr
        with admin.connect() as connection:
            tables = set(sa.inspect(connection).get_table_names(schema=schema))
        assert "pdserve_transfer_stats" in tables
    finally:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.mark.parametrize(("variable", "value"), [
    ("PDSERVE_GRPC_PORT", "abc"),
    ("PDSERVE_REDIS_URL", "http://nope"),
    ("PDSERVE_GRACE_PERIOD_S", "-3"),
])
def test_malformed_setting_stops_start_up_with_one_line(variable: str, value: str) -> None:
    result = _pdserve("serve", "kv-transfer", env={variable: value}, timeout=30)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert variable in lines[0]


def test_bad_database_url_names_the_variable() -> None:
    result = _pdserve("db", "upgrade", env={"PDSERVE_DATABASE_URL": "mysql://x/y"})
    assert result.returncode == 2
    assert "PDSERVE_DATABASE_URL" in result.stderr
