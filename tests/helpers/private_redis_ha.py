"""Private highly available Redis set-ups for tests: a Redis Cluster of 3 masters + 3 replicas,
and a Sentinel set-up of one master, one replica and three sentinels, each in a temporary
folder on free ports, torn down on exit.

    with private_redis_cluster() as cluster:
        backend = open_backend(cluster.url, clock)          # redis+cluster://127.0.0.1:P,...
        cluster.fail_over(master_port)                      # CLUSTER FAILOVER on its replica

    with private_sentinel() as sentinel:
        backend = open_backend(sentinel.url, clock)  # redis+sentinel://.../mymaster/0?replica_acks=1
        sentinel.fail_over()                                # SENTINEL FAILOVER mymaster

Nothing persists (``--save ""``, no AOF). A cluster node also listens on its bus port,
``port + 10000``, so both ports are checked free before a node is given one.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

from .private_redis import free_port

START_TIMEOUT_S = 30.0
CLUSTER_BUS_OFFSET = 10_000
NUM_CLUSTER_MASTERS = 3
SENTINEL_MASTER_NAME = "mymaster"
NUM_SENTINELS = 3


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not on PATH; install Redis to run this test")
    return path


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (``port + 10000``) is free too, not in ``taken``."""
    for _ in range(200):
        port = free_port()
        bus = port + CLUSTER_BUS_OFFSET
        if bus < 65536 and port not in taken and bus not in taken and _is_free(bus):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) found")


def redis_cli(port: int, *args: str, timeout_s: float = 10.0) -> str:
    """One ``redis-cli`` command against 127.0.0.1:``port``; its output as text."""
    done = subprocess.run(
        [_binary("redis-cli"), "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True, text=True, timeout=timeout_s, check=True)
    return done.stdout


def _info(port: int, section: str) -> dict[str, str]:
    try:
        text = redis_cli(port, "INFO", section, timeout_s=2.0)
    except (subprocess.SubprocessError, OSError):
        return {}
    fields = (line.partition(":") for line in text.splitlines() if ":" in line)
    return {name: value.strip() for name, _, value in fields}


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _has_synced_replica(master_port: int) -> bool:
    """The master's one replica has finished its initial sync (``state=online``): until then a
    failover to it may lose what the master acknowledged."""
    info = _info(master_port, "replication")
    return info.get("connected_slaves") == "1" and "state=online" in info.get("slave0", "")


class _Startable(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


_SetUp = TypeVar("_SetUp", bound=_Startable)


class _Processes:
    """redis-server processes started in one folder, each logging to its own file."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.by_port: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, port: int, *args: str) -> None:
        with open(self.directory / f"redis-{port}.log", "wb") as log:
            self.by_port[port] = subprocess.Popen(
                [_binary("redis-server"), *args], stdout=log, stderr=subprocess.STDOUT,
                cwd=self.directory)

    def kill(self, port: int) -> None:
        process = self.by_port.pop(port)
        process.kill()
        process.wait(timeout=5.0)

    def stop_all(self) -> None:
        for process in self.by_port.values():
            process.terminate()
        for process in self.by_port.values():
            try:
                process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5.0)
        self.by_port.clear()


def _server_args(port: int, directory: Path) -> list[str]:
    return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(directory), "--daemonize", "no", "--repl-diskless-sync-delay", "0"]


class PrivateRedisCluster:
    """Six cluster nodes: ``NUM_CLUSTER_MASTERS`` masters, one replica each."""

    def __init__(self, directory: Path) -> None:
        self._processes = _Processes(directory)
        taken: set[int] = set()
        self.ports: list[int] = []
        for _ in range(2 * NUM_CLUSTER_MASTERS):
            port = free_cluster_port(taken)
            taken.update({port, port + CLUSTER_BUS_OFFSET})
            self.ports.append(port)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> None:
        directory = self._processes.directory
        for port in self.ports:
            self._processes.start(
                port, *_server_args(port, directory), "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000")
        for port in self.ports:
            wait_for(lambda p=port: _info(p, "server").get("tcp_port") == str(p),
                     f"cluster node {port}")
        redis_cli(self.ports[0], "--cluster", "create",
                  *(f"127.0.0.1:{p}" for p in self.ports),
                  "--cluster-replicas", "1", "--cluster-yes", timeout_s=60.0)
        wait_for(self.is_healthy, "cluster_state:ok with every replica in sync")

    def is_healthy(self) -> bool:
        """Every running node says ``cluster_state:ok`` and every master has a synced replica."""
        for port in self._processes.by_port:
            try:
                if "cluster_state:ok" not in redis_cli(port, "CLUSTER", "INFO", timeout_s=2.0):
                    return False
            except (subprocess.SubprocessError, OSError):
                return False
        masters = self.master_ports()
        return len(masters) == NUM_CLUSTER_MASTERS and all(
            _has_synced_replica(p) for p in masters)

    def master_ports(self) -> list[int]:
        return sorted(p for p in self._processes.by_port
                      if _info(p, "replication").get("role") == "master")

    def replica_of(self, master_port: int) -> int:
        for port in self._processes.by_port:
            info = _info(port, "replication")
            if info.get("role") == "slave" and info.get("master_port") == str(master_port):
                return port
        raise RuntimeError(f"no replica of {master_port}")

    def fail_over(self, master_port: int) -> int:
        """A manual ``CLUSTER FAILOVER`` (the master pauses its clients until its replica has
        every write, then the replica takes over); returns the new master's port."""
        replica = self.replica_of(master_port)
        redis_cli(replica, "CLUSTER", "FAILOVER")
        wait_for(lambda: _info(replica, "replication").get("role") == "master",
                 f"replica {replica} promoted")
        return replica

    def crash(self, master_port: int, down_s: float = 0.0) -> int:
        """kill -9 of a master: its replica takes over once the cluster has marked it failed
        (``--cluster-node-timeout``), then, ``down_s`` later, the node starts again on its
        port with its own cluster config and rejoins as the new master's replica. Writes the
        master had acknowledged but not yet replicated are lost. Returns the new master."""
        replica = self.replica_of(master_port)
        self._processes.kill(master_port)
        wait_for(lambda: _info(replica, "replication").get("role") == "master",
                 f"replica {replica} promoted after its master was killed")
        time.sleep(down_s)
        directory = self._processes.directory
        self._processes.start(
            master_port, *_server_args(master_port, directory), "--cluster-enabled", "yes",
            "--cluster-config-file", f"nodes-{master_port}.conf", "--cluster-node-timeout", "2000")
        wait_for(self.is_healthy, f"node {master_port} back as a synced replica")
        return replica

    def stop(self) -> None:
        self._processes.stop_all()


class PrivateSentinel:
    """One master, one replica and ``NUM_SENTINELS`` sentinels watching them."""

    def __init__(self, directory: Path) -> None:
        self._processes = _Processes(directory)
        taken: set[int] = set()
        ports = []
        for _ in range(2 + NUM_SENTINELS):
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            ports.append(port)
        self.server_ports = ports[:2]
        self.sentinel_ports = ports[2:]

    @property
    def url(self) -> str:
        """Writes acknowledged once the replica has them, so a failover loses none."""
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SENTINEL_MASTER_NAME}/0?replica_acks=1"

    def start(self) -> None:
        directory = self._processes.directory
        master, replica = self.server_ports
        self._processes.start(master, *_server_args(master, directory))
        self._processes.start(replica, *_server_args(replica, directory),
                              "--replicaof", "127.0.0.1", str(master))
        wait_for(lambda: _has_synced_replica(master), "replica in sync")
        for port in self.sentinel_ports:
            config = directory / f"sentinel-{port}.conf"
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                f"sentinel monitor {SENTINEL_MASTER_NAME} 127.0.0.1 {master} 2\n"
                f"sentinel down-after-milliseconds {SENTINEL_MASTER_NAME} 2000\n"
                f"sentinel failover-timeout {SENTINEL_MASTER_NAME} 10000\n")
            self._processes.start(port, str(config), "--sentinel")
        wait_for(self._sentinels_agree, "every sentinel sees the master, the replica and peers")

    def _sentinels_agree(self) -> bool:
        master = self._named_master()
        if master is None:
            return False
        for port in self.sentinel_ports:
            info = _info(port, "sentinel")
            if f"address=127.0.0.1:{master}" not in info.get("master0", ""):
                return False
            if f"sentinels={NUM_SENTINELS}" not in info.get("master0", ""):
                return False
            if "slaves=1" not in info.get("master0", ""):
                return False
        return True

    def master_port(self) -> int:
        """The master's port as the first sentinel names it."""
        port = self._named_master()
        if port is None:
            raise RuntimeError(f"sentinel {self.sentinel_ports[0]} names no master")
        return port

    def _named_master(self) -> int | None:
        """The master's port, or None while the first sentinel does not answer (starting)."""
        try:
            reply = redis_cli(self.sentinel_ports[0], "SENTINEL", "get-master-addr-by-name",
                              SENTINEL_MASTER_NAME, timeout_s=2.0).split()
            return int(reply[1])
        except (subprocess.SubprocessError, OSError, IndexError, ValueError):
            return None

    def fail_over(self) -> int:
        """``SENTINEL FAILOVER``: the replica is promoted; returns the new master's port once
        the sentinels name it and the old master has rejoined as its replica."""
        old = self.master_port()
        new = next(p for p in self.server_ports if p != old)
        redis_cli(self.sentinel_ports[0], "SENTINEL", "FAILOVER", SENTINEL_MASTER_NAME)
        wait_for(lambda: self._named_master() == new, "the sentinels naming the new master")
        wait_for(lambda: _info(old, "replication").get("master_link_status") == "up",
                 "the old master rejoining as a replica", timeout_s=60.0)
        return new

    def stop(self) -> None:
        self._processes.stop_all()


def _started(make: Callable[[], _SetUp]) -> _SetUp:
    """A started set-up, each try in its own folder; tried once more on fresh ports if a port
    was taken between choosing and binding it."""
    setup = make()
    try:
        setup.start()
    except (RuntimeError, subprocess.SubprocessError):
        setup.stop()
        setup = make()
        setup.start()
    return setup


@contextmanager
def private_redis_cluster() -> Iterator[PrivateRedisCluster]:
    with tempfile.TemporaryDirectory(prefix="pdserve-cluster-") as directory:
        cluster = _started(lambda: PrivateRedisCluster(Path(tempfile.mkdtemp(dir=directory))))
        try:
            yield cluster
        finally:
            cluster.stop()


@contextmanager
def private_sentinel() -> Iterator[PrivateSentinel]:
    with tempfile.TemporaryDirectory(prefix="pdserve-sentinel-") as directory:
        sentinel = _started(lambda: PrivateSentinel(Path(tempfile.mkdtemp(dir=directory))))
        try:
            yield sentinel
        finally:
            sentinel.stop()
