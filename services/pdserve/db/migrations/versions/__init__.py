"""Schema revisions, oldest first. Each is written by hand to match ``pdserve.db.models``."""
