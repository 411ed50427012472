"""Database URLs and engines: Postgres through psycopg 3, or SQLite for one machine.

Accepted ``PDSERVE_DATABASE_URL`` forms:

- ``postgresql+psycopg://user[:password]@host[:port]/dbname`` (``postgresql://`` and
  ``postgres://`` are read as the same thing: psycopg 3 is the only Postgres driver pdserve ships);
- ``sqlite:///relative/or/absolute/path.db`` (four slashes for an absolute path), or ``sqlite://``
  for a private in-memory database that lives as long as its engine.

Engines are synchronous; asyncio services call the repository through ``asyncio.to_thread``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from pdserve.common.errors import ConfigError

SETTING = "PDSERVE_DATABASE_URL"
EXPECTED_FORM = (
    "postgresql+psycopg://user[:password]@host[:port]/dbname, or sqlite:///path/to/file.db "
    "(sqlite:// for in-memory)"
)
_POSTGRES_DRIVERS = {"postgresql", "postgres", "postgresql+psycopg"}
_SQLITE_DRIVERS = {"sqlite", "sqlite+pysqlite"}

json_serializer = functools.partial(json.dumps, allow_nan=False, separators=(",", ":"))
"""Strict JSON: NaN and infinity are refused on SQLite exactly as Postgres JSONB refuses them."""


def _config_error(detail: str) -> ConfigError:
    return ConfigError(f"{SETTING} {detail}; expected {EXPECTED_FORM}", field=SETTING)


def normalize_url(url: str | URL) -> URL:
    """Parse and check a database URL; Postgres URLs get the psycopg 3 driver.

    Raises ``ConfigError`` (naming ``PDSERVE_DATABASE_URL`` and the expected form) for anything
    else. The message shows the URL with its password masked.
    """
    if isinstance(url, str):
        if not url.strip():
            raise _config_error("is empty")
        try:
            parsed = sa.make_url(url.strip())
        except ArgumentError:
            raise _config_error("could not be parsed as a URL") from None
    else:
        parsed = url
    shown = parsed.render_as_string(hide_password=True)
    if parsed.drivername in _POSTGRES_DRIVERS:
        if not parsed.database:
            raise _config_error(f"names no database ({shown!r})")
        return parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername in _SQLITE_DRIVERS:
        if parsed.host or parsed.username or parsed.port:
            raise _config_error(f"gives a host to SQLite ({shown!r})")
        return parsed.set(drivername="sqlite")
    raise _config_error(f"uses an unsupported scheme {parsed.drivername!r} ({shown!r})")


def is_sqlite_memory(url: URL) -> bool:
    """True for ``sqlite://`` and ``sqlite:///:memory:``: one database per connection."""
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def make_engine(url: str | URL, **engine_kwargs: Any) -> Engine:
    """An engine for a checked URL (see ``normalize_url``).

    SQLite files get their parent directory created, WAL journaling (readers never wait for the
    writer) and a 5 s busy timeout; an in-memory SQLite engine keeps a single shared connection so
    every thread sees the same database (``Repository`` then runs one transaction at a time).
    Postgres connections are checked before use, so a database restart costs one failed ping,
    not one failed call.
    """
    checked = normalize_url(url)
    kwargs: dict[str, Any] = {"json_serializer": json_serializer}
    if checked.get_backend_name() == "sqlite":
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 5.0}
        if is_sqlite_memory(checked):
            kwargs["poolclass"] = StaticPool
        else:
            Path(checked.database or "").parent.mkdir(parents=True, exist_ok=True)
    else:
        kwargs["pool_pre_ping"] = True
    kwargs.update(engine_kwargs)
    engine = sa.create_engine(checked, **kwargs)
    if checked.get_backend_name() == "sqlite" and not is_sqlite_memory(checked):
        sa.event.listen(engine, "connect", _sqlite_on_connect)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()
