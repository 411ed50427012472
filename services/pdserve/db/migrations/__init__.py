"""Alembic scripts of pdserve's durable store. Run them through ``pdserve.db.migrate``."""
