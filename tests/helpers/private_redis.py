"""A private ``redis-server`` on a free port in a temporary folder, which a test may stop and
restart at will (unlike the shared Redis that ``redis_url`` names, which tests never restart).

    with private_redis() as server:
        backend = open_backend(server.url, clock)
        ...
        server.restart()   # every key is gone: no persistence (--save "", --appendonly no)
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

START_TIMEOUT_S = 10.0


_HANDED_OUT: set[int] = set()
_LOWEST_PORT = 10_000


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _worker_slice(low: int, high: int) -> tuple[int, int]:
    """This process's share of ``[low, high)``: all of it, or under pytest-xdist (``-n``) the
    worker's own slice, so that two workers never pick the same port (each one's record of the
    ports it handed out is its own)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        index = int(worker.removeprefix("gw"))
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    except ValueError:
        return low, high
    if not 0 <= index < count:
        return low, high
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width


def free_port() -> int:
    """A loopback port that nothing holds now and that a server started later can still bind.

    A port the kernel hands out for ``bind(0)`` lies in its ephemeral range, from which every
    outgoing connection also takes its local port: a test that picks ports first and starts its
    servers one by one (or restarts a killed server on its old port) would now and then find one
    taken by some client's connection (seen in CI as "Address already in use"). So this picks
    below that range, at random (in the pytest-xdist worker's own slice of it), never the same
    port twice in one test run, and falls back to ``bind(0)`` only where the range leaves no
    room below it."""
    low, high = _worker_slice(_LOWEST_PORT, _ephemeral_range_start())
    if high - low >= 1_000:
        for _ in range(1_000):
            port = random.randrange(low, high)
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class PrivateRedis:
    """One redis-server process owned by the test; ``restart`` keeps the port, loses the data."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH; install Redis to run this test")
        self._binary = binary
        self._directory = directory
        self.port = port or free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self.num_starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self._process is None, "already running"
        log = open(self._directory / f"redis-{self.num_starts}.log", "wb")  # noqa: SIM115
        self._process = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self._directory), "--daemonize", "no"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.num_starts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5.0)

    def restart(self) -> None:
        """Stop and start on the same port; all data is lost."""
        self.stop()
        self.start()


@contextmanager
def private_redis() -> Iterator[PrivateRedis]:
    """A started private Redis, stopped (and its folder removed) on exit."""
    with tempfile.TemporaryDirectory(prefix="pdserve-redis-") as directory:
        server = PrivateRedis(Path(directory))
        try:
            server.start()
        except RuntimeError:
            server = PrivateRedis(Path(directory))  # the free port was taken meanwhile
            server.start()
        try:
            yield server
        finally:
            server.stop()
