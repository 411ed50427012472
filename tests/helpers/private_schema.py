"""A ``Repository`` on a schema of its own in the test database, migrated to head and dropped
afterwards, so that tests sharing one PostgreSQL never see each other's rows."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import sqlalchemy as sa
from sqlalchemy.engine import URL

from pdserve.db import Repository, make_engine, normalize_url, upgrade


@contextlib.contextmanager
def private_schema_repository(database_url: str, prefix: str) -> Iterator[Repository]:
    """A repository on schema ``<prefix>_<random>`` of ``database_url``."""
    admin = make_engine(database_url)
    schema = f"{prefix}_{secrets.token_hex(6)}"
    with admin.begin() as connection:
        connection.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url: URL = normalize_url(database_url).update_query_dict(
        {"options": f"-csearch_path={schema}"})
    engine = make_engine(url)
    try:
        upgrade(engine)
        yield Repository(engine)
    finally:
        engine.dispose()
        with admin.begin() as connection:
            connection.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
