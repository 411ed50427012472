"""``pdserve db upgrade|current``: the durable schema (Alembic revisions shipped in the package)."""

from __future__ import annotations

import argparse
import os

from pdserve.common.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=("upgrade", "current"), help="upgrade to head, or show the revision"
    )
    parser.add_argument("--database-url", default=None,
                        help="SQLAlchemy URL [PDSERVE_DATABASE_URL; default sqlite:///pdserve.db]")
    parser.add_argument("--revision", default="head", help="target revision of upgrade")


def run(args: argparse.Namespace) -> int:
    from pdserve.db import current, upgrade

    url = args.database_url or os.environ.get("PDSERVE_DATABASE_URL") or "sqlite:///pdserve.db"
    if url.startswith("sqlite://") and url in ("sqlite://", "sqlite:///:memory:"):
        raise ConfigError("PDSERVE_DATABASE_URL: an in-memory SQLite database cannot be upgraded "
                          "from the command line (it would vanish); give a file or Postgres URL")
    if args.action == "upgrade":
        revision = upgrade(url, args.revision)
        print(f"database at revision {revision}")
    else:
        print(current(url) or "empty (no revision)")
    return 0
