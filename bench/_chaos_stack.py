"""The chaos harness's stack: every pdserve service as a real process on a private Redis and
(optionally) a private PostgreSQL, a supervisor that restarts what the faults kill, and a
monitor of the decode workers' fencing counters.

Built on the fault-test plumbing in ``tests/e2e/faults.py`` (``build_stack``, ``Stack``,
``kill9``, ``settled_audit``) and ``tests/e2e/conftest.py`` (``ServiceProcess``); this module adds
what a long mixed run needs on top: governors (active/standby), workers whose clocks are skewed,
restarts after a delay, and counters that survive the workers that reported them.

Importable from the bench scripts (``bench/`` on ``sys.path``) and from the e2e tests (which put
``bench/`` there themselves); it puts ``tests/`` on ``sys.path`` for the e2e helpers.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

import grpc
import pytest
from e2e.conftest import ServiceProcess, run_cli
from e2e.faults import (
    MODEL,
    Stack,
    build_stack,
    list_workers,
    ready_counts,
    wait_until,
)
from helpers.private_postgres import PrivatePostgres
from helpers.private_redis import PrivateRedis
from helpers.private_redis_ha import PrivateRedisCluster

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc
from pdserve.common.convert import token_from_pb

HarnessFailure = (Exception, pytest.fail.Exception)
"""What a failed wait of the e2e plumbing raises (``pytest.fail`` is not an ``Exception``)."""
GOVERNOR_LEASE_KEY = "pdserve:lease:{governor}"


def log(message: str) -> None:
    """Progress, on stderr (stdout is the report)."""
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """What runs. Durations in seconds."""

    num_replicas: int = 2
    """Coordinators, and pool managers of each role."""
    num_routers: int = 2
    num_prefill: int = 2
    num_decode: int = 2
    num_governors: int = 2
    """Active/standby on a Redis lease; 0 = none."""
    worker_args: tuple[str, ...] = ("--speedup", "1", "--num-kv-layers", "4",
                                    "--max-num-blocks", "2048",
                                    "--test-prefill-hold-signals", "true",
                                    "--max-prefill-stall-s", "1")
    """Real-time simulated H100s: a 1,000-token prefill takes tens of milliseconds and 32 tokens
    of decode a few hundred, long enough to catch a worker in the middle of each phase. SIGUSR1
    and SIGUSR2 hold and release a prefill worker's loop (``stall_prefill_loop``)."""
    max_prefill_stall_s: float = 1.0
    """As in ``worker_args``: how long a held prefill loop renews its queued leases."""
    lease_s: float = 3.0
    """Ticket lease the routers ask for: how long a stalled transfer holds its blocks."""
    heartbeat_timeout_s: float = 2.0
    governor_lease_s: float = 2.0
    clock_skew_s: float = 3600.0
    """The last prefill worker runs this far ahead, the last decode worker this far behind
    (0 = no skewed workers)."""
    is_private_postgres: bool = True
    """Start a PostgreSQL of our own (needed to take it down); else use the URL given."""
    state: str = "redis"
    """Hot state: ``redis`` (one private node) or ``redis-cluster`` (a private Redis Cluster
    of three masters and three replicas)."""

    @property
    def pool_args(self) -> tuple[str, ...]:
        # Provisioning on, but no target: nothing is launched or drained until SetTargetSize
        # (the scale-down phase); the workers are the harness's, restarted by its supervisor.
        return ("--heartbeat-timeout-s", str(self.heartbeat_timeout_s), "--is-provisioning")

    @property
    def router_args(self) -> tuple[str, ...]:
        return ("--lease-s", str(self.lease_s))


class ChaosStack:
    """The running stack. ``processes`` collects every process started (restarts included);
    ``close`` stops them all, newest first."""

    def __init__(self, config: ChaosConfig, work_dir: Path,
                 processes: list[ServiceProcess] | None = None) -> None:
        self.config = config
        self.work_dir = work_dir
        self.processes: list[ServiceProcess] = processes if processes is not None else []
        self.redis: PrivateRedis | None = None
        self.cluster: PrivateRedisCluster | None = None
        self.postgres: PrivatePostgres | None = None
        self.database_url = ""
        self.spool_dir = work_dir / "spool"
        self.stack: Stack | None = None
        self.governors: list[ServiceProcess] = []
        self.skewed: set[str] = set()
        """Names of the workers with a skewed clock."""

    # -- start and stop -------------------------------------------------------------------------

    def start(self, database_url: str | None = None) -> ChaosStack:
        """Private Redis (and PostgreSQL unless ``database_url``), then the services; returns once
        every router sees every worker READY."""
        config = self.config
        if config.state == "redis-cluster":
            (self.work_dir / "redis-cluster").mkdir()
            self.cluster = PrivateRedisCluster(self.work_dir / "redis-cluster")
            self.cluster.start()
            redis_url = self.cluster.url
        else:
            self.redis = PrivateRedis(self.work_dir / "redis")
            (self.work_dir / "redis").mkdir()
            self.redis.start()
            redis_url = self.redis.url
        if database_url is None:
            assert config.is_private_postgres
            pg_dir = self.work_dir / "postgres"
            pg_dir.mkdir()
            pg_dir.chmod(0o755)
            self.work_dir.chmod(0o755)
            self.postgres = PrivatePostgres(pg_dir)
            self.postgres.start()
            result = run_cli(["db", "upgrade", "--database-url", self.postgres.url])
            if result.returncode != 0:
                raise RuntimeError(f"pdserve db upgrade failed:\n{result.stdout}{result.stderr}")
            database_url = self.postgres.url
        self.database_url = database_url
        num_skewed = 1 if config.clock_skew_s else 0
        self.stack = build_stack(
            self.processes, redis_url, database_url, num_replicas=config.num_replicas,
            num_routers=config.num_routers, num_prefill=config.num_prefill - num_skewed,
            num_decode=config.num_decode - num_skewed, pool_args=config.pool_args,
            router_args=config.router_args, worker_args=config.worker_args,
            extra_env={"PDSERVE_DURABLE_SPOOL_DIR": str(self.spool_dir)})
        if num_skewed:
            for role, group, sign in (("prefill", self.stack.prefill_workers, 1),
                                      ("decode", self.stack.decode_workers, -1)):
                name = f"{role}-worker-skewed"
                group.append(self.stack.start_worker(
                    role, name, {"PDSERVE_TEST_CLOCK_OFFSET_S": str(sign * config.clock_skew_s)}))
                self.skewed.add(name)
            for worker in self.stack.workers:
                worker.wait_ready()
        for i in range(config.num_governors):
            self.governors.append(self._start_governor(i))
        for governor in self.governors:
            governor.wait_ready()
        self.wait_full_strength(60.0)
        return self

    def _start_governor(self, index: int) -> ServiceProcess:
        assert self.stack is not None
        # Recommend-only: its decisions (and their Postgres records) go on, but targets stay
        # with the harness, whose supervisor owns the workers.
        process = ServiceProcess(f"governor-{index}", [
            "serve", "governor", "--autoscale-deployments", MODEL, "--is-autoscaler-dry-run",
            "--autoscale-interval-s", "2", "--leader-lease-s", str(self.config.governor_lease_s)],
            self.stack.env)
        self.processes.append(process.start())
        return process

    def close(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(*HarnessFailure):
                process.stop()
        if self.postgres is not None and self.postgres.is_running():
            with contextlib.suppress(RuntimeError):
                self.postgres.stop()
        if self.redis is not None:
            self.redis.stop()
        if self.cluster is not None:
            self.cluster.stop()

    # -- views ----------------------------------------------------------------------------------

    @property
    def services(self) -> Stack:
        """The e2e fault-test stack underneath (its process groups, addresses, restarts)."""
        assert self.stack is not None, "not started"
        return self.stack

    def expected_counts(self) -> tuple[int, int]:
        return len(self.services.prefill_workers), len(self.services.decode_workers)

    def is_full_strength(self) -> bool:
        """Every router answers and sees every worker READY."""
        expected = self.expected_counts()
        return all(ready_counts(r.grpc_address) == expected for r in self.services.routers)

    def wait_full_strength(self, timeout_s: float = 45.0) -> bool:
        return wait_until(self.is_full_strength, timeout_s, 0.1)

    def group_of(self, process: ServiceProcess) -> list[ServiceProcess]:
        services = self.services
        for group in (
            services.coordinators,
            services.prefill_pools,
            services.decode_pools,
            services.routers,
            services.prefill_workers,
            services.decode_workers,
            self.governors,
        ):
            if any(p is process for p in group):
                return group
        raise ValueError(f"{process.name} is not in the stack")

    def governor_holder_pid(self) -> int | None:
        """Pid of the governor holding the active lease (holder ``host:pid:...``)."""
        import redis

        client: Any
        if self.cluster is not None:
            from redis.cluster import ClusterNode, RedisCluster

            client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port)
                                                 for port in self.cluster.ports],
                                  socket_timeout=2)
        else:
            assert self.redis is not None
            client = redis.Redis.from_url(self.redis.url, socket_timeout=2)
        try:
            value = client.get(GOVERNOR_LEASE_KEY)
        finally:
            client.close()
        if not value:
            return None
        parts = value.decode().partition("|")[2].split(":")
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None

    def ready_in_pools(self) -> dict[str, int]:
        """READY workers of each role in the shared store."""
        counts = {"prefill": 0, "decode": 0}
        for info in list_workers(self.services.pool_address("decode")):
            if info.state == pb.WORKER_STATE_READY:
                counts["prefill" if info.role == pb.WORKER_ROLE_PREFILL else "decode"] += 1
        return counts

    # -- supervisor -----------------------------------------------------------------------------

    def restart(self, old: ServiceProcess) -> ServiceProcess:
        """The same command again (a control-plane service on its old port; a worker with its
        old settings, clock skew included, under a new id) in ``old``'s slot; waits for its
        'ready' line."""
        group = self.group_of(old)
        new = self.services.restart(old)
        group[next(i for i, p in enumerate(group) if p is old)] = new
        new.wait_ready()
        return new


@dataclass(slots=True)
class FencingMonitor:
    """Polls every worker's GetStatus through the run and keeps what a worker killed later
    would take with it: per worker id, the highest count of frames refused and of late writes
    accepted it reported; per handoff, the KV checksum the prefill side sent and the one the
    decode side accepted (each worker keeps only its own recent ones, and only live workers
    answer the final audit)."""

    stack: ChaosStack
    period_s: float = 2.0
    late_writes: dict[str, int] = field(default_factory=dict)
    refused_frames: dict[str, int] = field(default_factory=dict)
    sent_checksums: dict[str, int] = field(default_factory=dict)
    """Fencing token -> CRC-32 of the prompt KV as sent."""
    accepted_checksums: dict[str, int] = field(default_factory=dict)
    """Fencing token -> CRC-32 of the prompt KV as accepted."""
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self) -> FencingMonitor:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.poll_once()

    async def _run(self) -> None:
        while not self._stop.is_set():
            await self.poll_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.period_s)

    async def poll_once(self) -> None:
        services = self.stack.services
        await asyncio.gather(*(
            self._poll(worker, checksums)
            for group, checksums in ((services.prefill_workers, self.sent_checksums),
                                     (services.decode_workers, self.accepted_checksums))
            for worker in group if worker.returncode is None and worker.grpc_address))

    async def _poll(self, worker: ServiceProcess, checksums: dict[str, int]) -> None:
        try:
            async with grpc.aio.insecure_channel(worker.grpc_address) as channel:
                status = await worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
                    worker_pb2.GetStatusRequest(), timeout=2)
        except grpc.RpcError:
            return  # stopped, frozen or gone: its last answer stands
        key = worker.worker_id or worker.name
        self.late_writes[key] = max(self.late_writes.get(key, 0), status.num_late_writes_accepted)
        self.refused_frames[key] = max(self.refused_frames.get(key, 0), status.num_refused_frames)
        for checksum in status.kv_checksums:
            checksums[str(token_from_pb(checksum.token))] = checksum.crc32

    @property
    def num_late_writes_accepted(self) -> int:
        return sum(self.late_writes.values())

    @property
    def num_refused_frames(self) -> int:
        return sum(self.refused_frames.values())

    @property
    def num_checksums_compared(self) -> int:
        return len(self.sent_checksums.keys() & self.accepted_checksums.keys())

    @property
    def checksum_mismatches(self) -> list[str]:
        """Handoffs whose accepted KV differs from what was sent."""
        both = self.sent_checksums.keys() & self.accepted_checksums.keys()
        return sorted(t for t in both if self.sent_checksums[t] != self.accepted_checksums[t])


async def phases_of(stub: worker_pb2_grpc.WorkerAgentServiceStub) -> set[str]:
    """Phases of the worker's tickets in flight (empty if it does not answer)."""
    try:
        status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=1)
    except grpc.RpcError:
        return set()
    return {t.phase for t in status.tickets}


async def catch_in_phase(workers: list[ServiceProcess], phase: str, timeout_s: float = 20.0,
                         poll_s: float = 0.005) -> ServiceProcess | None:
    """The first worker seen with a ticket in ``phase`` (prefilling, sending, decoding, ...),
    polled every ``poll_s`` over one channel per worker; None if none is within ``timeout_s``."""
    live = [w for w in workers if w.returncode is None and w.grpc_address]
    channels = [grpc.aio.insecure_channel(w.grpc_address) for w in live]
    stubs = [worker_pb2_grpc.WorkerAgentServiceStub(c) for c in channels]
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            found = await asyncio.gather(*(phases_of(stub) for stub in stubs))
            for worker, phases in zip(live, found, strict=True):
                if phase in phases:
                    return worker
            await asyncio.sleep(poll_s)
        return None
    finally:
        for channel in channels:
            await channel.close()
