"""Alembic environment: migrate over the connection that ``pdserve.db.migrate`` opened.

There is no ``alembic.ini`` and no URL in the configuration: ``pdserve.db.migrate`` parses
``PDSERVE_DATABASE_URL``, opens the transaction (and on Postgres takes the migration lock), and
passes the connection in ``config.attributes["connection"]``. Offline (``--sql``) mode is not
offered.
"""

from __future__ import annotations

from alembic import context

from pdserve.db.migrate import VERSION_TABLE
from pdserve.db.models import Base

connection = context.config.attributes.get("connection")
if context.is_offline_mode() or connection is None:
    raise RuntimeError(
        "pdserve migrations run through pdserve.db.migrate (`pdserve db upgrade`), "
        "which supplies the database connection"
    )

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    version_table=VERSION_TABLE,
    compare_type=True,
    # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
