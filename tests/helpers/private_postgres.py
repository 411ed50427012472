"""A private PostgreSQL server on a free port in a temporary folder, which a test may stop and
start at will (the shared server that ``database_url`` names is never stopped).

    with private_postgres() as server:
        url = server.url          # postgresql+psycopg://postgres@127.0.0.1:<port>/postgres
        server.stop()             # the database is down
        server.start()            # and back, with its data

``initdb`` and ``pg_ctl`` come from ``/usr/lib/postgresql/<version>/bin`` (or PATH). PostgreSQL
refuses to run as root, so under root the server runs as the ``postgres`` user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .private_redis import free_port

START_TIMEOUT_S = 30


def _binary(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found (install PostgreSQL's server package)")
    return path


class PrivatePostgres:
    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._data = directory / "data"
        self.port = free_port()
        self._user = "postgres" if os.geteuid() == 0 else None
        self._initdb()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str], timeout_s: float = START_TIMEOUT_S) -> None:
        command = args if self._user is None else ["runuser", "-u", self._user, "--", *args]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed:\n{result.stdout}{result.stderr}")

    def _initdb(self) -> None:
        self._data.mkdir()
        if self._user is not None:
            record = pwd.getpwnam(self._user)
            for path in (self._directory, self._data):
                os.chown(path, record.pw_uid, record.pw_gid)
        self._run([_binary("initdb"), "-D", str(self._data), "-U", "postgres", "-A", "trust",
                   "--no-sync", "-E", "UTF8"])

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c unix_socket_directories={self._directory}")
        self._run([_binary("pg_ctl"), "-D", str(self._data), "-o", options, "-w",
                   "-t", str(START_TIMEOUT_S), "-l", str(self._directory / "server.log"), "start"])

    def stop(self) -> None:
        """Stop at once (``-m immediate``: connections are cut, like a crash)."""
        self._run([_binary("pg_ctl"), "-D", str(self._data), "-m", "immediate", "-w", "stop"])

    def is_running(self) -> bool:
        return (self._data / "postmaster.pid").exists()


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started private PostgreSQL, stopped (and its folder removed) on exit."""
    with tempfile.TemporaryDirectory(prefix="pdserve-pg-") as directory:
        os.chmod(directory, 0o755)
        server = PrivatePostgres(Path(directory))
        server.start()
        try:
            yield server
        finally:
            if server.is_running():
                try:
                    server.stop()
                except RuntimeError:
                    pass
