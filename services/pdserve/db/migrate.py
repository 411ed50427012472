"""Schema migrations, driven from Python: ``upgrade``, ``downgrade``, ``current``, ``schema_diff``.

Alembic is configured here in code; its scripts ship inside the package
(``pdserve/db/migrations``), so an installed wheel can migrate with no ``alembic.ini``. Every
function takes a database URL (see ``pdserve.db.engine``) or an ``Engine``; pass the engine for
an in-memory SQLite database, which exists only as long as the engine that holds it.

Alembic keeps its revision in ``pdserve_alembic_version`` (not ``alembic_version``), so pdserve
can share a database with another Alembic-managed application. On Postgres an upgrade holds a
transaction-scoped advisory lock (``MIGRATION_LOCK_KEY``): replicas that start together migrate
one after the other, and the DDL of an upgrade commits all at once or not at all. Within one
process, migrations run one at a time (Alembic's ``context`` is process-wide).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy.engine import URL, Connection, Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from pdserve.common.errors import ConfigError, UnavailableError
from pdserve.db.engine import SETTING, make_engine
from pdserve.db.models import Base

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "pdserve_alembic_version"
TABLE_PREFIX = "pdserve_"
MIGRATION_LOCK_KEY = 0x70647365  # "pdse": the Postgres advisory lock all pdserve migrations take
_ALEMBIC_LOCK = threading.Lock()  # Alembic's `context` and `op` are process-wide proxies

Target = str | URL | Engine
"""A database URL (string or parsed) or an engine bound to one."""


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic configuration for pdserve's scripts; ``env.py`` migrates over ``connection``."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head() -> str:
    """The newest revision this pdserve version ships."""
    revision = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert revision is not None, "pdserve ships at least one revision"
    return revision


@contextmanager
def _transaction(target: Target) -> Iterator[Connection]:
    engine = target if isinstance(target, Engine) else make_engine(target)
    try:
        with engine.begin() as connection:
            yield connection
    except (OperationalError, InterfaceError) as error:
        raise UnavailableError(f"database unavailable: {str(error.orig).strip()}") from error
    finally:
        if engine is not target:
            engine.dispose()


def _current(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def _lock(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"),
                           {"key": MIGRATION_LOCK_KEY})


@contextmanager
def _explained(revision: str) -> Iterator[None]:
    """Alembic's errors (unknown revision asked for, or found in the database, e.g. one written by
    a newer pdserve) as ``ConfigError``."""
    try:
        yield
    except CommandError as error:
        raise ConfigError(
            f"cannot migrate to {revision!r}: {error} (this pdserve knows revisions up to "
            f"{head()})"
        ) from error


def upgrade(target: Target, revision: str = "head") -> str | None:
    """Migrate the database up to ``revision``; returns the revision it is at afterwards.

    Idempotent: upgrading a database that is already there changes nothing. Raises
    ``ConfigError`` for a bad URL, or for a revision (asked for, or found in the database) that
    this pdserve does not ship; ``UnavailableError`` if the database cannot be reached.
    """
    with _ALEMBIC_LOCK, _transaction(target) as connection, _explained(revision):
        _lock(connection)
        command.upgrade(alembic_config(connection), revision)
        return _current(connection)


def downgrade(target: Target, revision: str) -> str | None:
    """Migrate down to ``revision`` (``"base"`` drops every pdserve table, and its data)."""
    with _ALEMBIC_LOCK, _transaction(target) as connection, _explained(revision):
        _lock(connection)
        command.downgrade(alembic_config(connection), revision)
        return _current(connection)


def current(target: Target) -> str | None:
    """The revision the database is at; None for a database pdserve never migrated."""
    with _transaction(target) as connection:
        return _current(connection)


def check_at_head(target: Target) -> None:
    """Raise ``ConfigError`` unless the database is at ``head()``: services call this at start-up
    instead of failing later on a missing table or column."""
    at, expected = current(target), head()
    if at != expected:
        raise ConfigError(
            f"database at {SETTING} is at schema revision {at or 'none'}, this pdserve needs "
            f"{expected}: run `pdserve db upgrade`",
            field=SETTING,
        )


def _is_pdserve_table(name: str | None, type_: str, _parent: Any) -> bool:
    if type_ != "table":
        return True
    return name is not None and name.startswith(TABLE_PREFIX) and name != VERSION_TABLE


def schema_diff(target: Target) -> list[Any]:
    """What differs between the ORM models and the database's pdserve tables (Alembic
    autogenerate operations; empty when they match). Other applications' tables are ignored."""
    with _transaction(target) as connection:
        context = MigrationContext.configure(
            connection,
            opts={
                "compare_type": True,
                "version_table": VERSION_TABLE,
                "include_name": _is_pdserve_table,
            },
        )
        return list(compare_metadata(context, Base.metadata))
