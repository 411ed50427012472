"""Fault-injection plumbing shared by the ``test_faults_*`` e2e tests (and the chaos bench): a
stack of real processes with replicated control-plane services on fixed ports (so a killed
replica restarts where its peers and clients expect it), a load generator that classifies every
request, and the settle check (``pdserve audit``'s reconcile: ledgers exact, checksums equal,
no late write).

Request outcomes, as a client that follows gRPC's retry semantics sees them:

- ``completed``: the stream ended cleanly with every token asked for;
- ``failed``: the stream ended with a gRPC error status (a clean failure);
- ``truncated``: the stream ended cleanly with fewer tokens than asked (must never happen);
- ``hung``: no end within ``HANG_S`` (must never happen).

The client retries a call that failed UNAVAILABLE before any response on the next router
replica (gRPC's rule for a call that is safe to repeat), like a gRPC client with several targets;
one that failed UNAVAILABLE after some tokens (its router replica died) it resumes on the next
replica with the same request id and the tokens it has (``resume_token_ids``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest
from helpers.private_redis import free_port

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import (
    pool_pb2,
    pool_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pdserve.cli.audit import AuditReport, audit
from pdserve.common.grpc_client import channel_target

from .conftest import ServiceProcess

MODEL = "llama-3.1-8b"
MAX_TOKENS = 16
HANG_S = 60.0
"""A request with no end after this long counts as hung."""
WORKER_ARGS = ("--speedup", "200", "--num-kv-layers", "4", "--max-num-blocks", "2048")
CLIENT_TRIES = 6
"""Tries per request over the router replicas for UNAVAILABLE-before-any-response."""


def kill9(process: ServiceProcess) -> None:
    """SIGKILL of the process (and its process group: it runs in a session of its own)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        process.wait_exit(10.0)


@dataclass(slots=True)
class Stack:
    """The processes of one fault test. ``processes`` (the e2e fixture) stops them all at the
    end, restarted ones included."""

    processes: list[ServiceProcess]
    env: dict[str, str]
    join_token: str
    coordinator_ports: list[int]
    prefill_pool_ports: list[int]
    decode_pool_ports: list[int]
    router_ports: list[int] = field(default_factory=list)
    pool_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = WORKER_ARGS
    coordinators: list[ServiceProcess] = field(default_factory=list)
    prefill_pools: list[ServiceProcess] = field(default_factory=list)
    decode_pools: list[ServiceProcess] = field(default_factory=list)
    routers: list[ServiceProcess] = field(default_factory=list)
    prefill_workers: list[ServiceProcess] = field(default_factory=list)
    decode_workers: list[ServiceProcess] = field(default_factory=list)

    @staticmethod
    def _addresses(ports: list[int]) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in ports)

    @property
    def coordinator_address(self) -> str:
        return self._addresses(self.coordinator_ports)

    def pool_address(self, role: str) -> str:
        return self._addresses(self.prefill_pool_ports if role == "prefill"
                               else self.decode_pool_ports)

    @property
    def router_addresses(self) -> list[str]:
        """Fixed: a restarted router answers at its old address."""
        return [f"127.0.0.1:{port}" for port in self.router_ports]

    @property
    def workers(self) -> list[ServiceProcess]:
        return [*self.prefill_workers, *self.decode_workers]

    def _start(self, process: ServiceProcess) -> ServiceProcess:
        self.processes.append(process.start())
        return process

    def start_coordinator(self, index: int) -> ServiceProcess:
        return self._start(ServiceProcess(f"kv-transfer-{index}", [
            "serve", "kv-transfer", "--grpc-port", str(self.coordinator_ports[index])], self.env))

    def start_pool(self, role: str, index: int) -> ServiceProcess:
        ports = self.prefill_pool_ports if role == "prefill" else self.decode_pool_ports
        # ``{coordinator}`` and ``{pool}`` in pool_args: the addresses (provisioned workers).
        args = [a.format(coordinator=self.coordinator_address, pool=self.pool_address(role),
                         role=role) for a in self.pool_args]
        return self._start(ServiceProcess(f"{role}-pool-{index}", [
            "serve", f"{role}-pool", "--deployments", MODEL, "--grpc-port", str(ports[index]),
            *args], {**self.env, "PDSERVE_JOIN_TOKEN": self.join_token}))

    def start_router(self, index: int) -> ServiceProcess:
        while len(self.router_ports) <= index:
            self.router_ports.append(free_port())
        return self._start(ServiceProcess(f"router-{index}", [
            "serve", "router", "--coordinator-address", self.coordinator_address,
            "--grpc-port", str(self.router_ports[index]), "--http-port", "-1",
            *self.router_args], self.env))

    def start_worker(self, role: str, name: str, extra_env: dict[str, str] | None = None,
                     extra_args: tuple[str, ...] = ()) -> ServiceProcess:
        env = {**self.env, "PDSERVE_JOIN_TOKEN": self.join_token, **(extra_env or {})}
        return self._start(ServiceProcess(name, [
            "serve", "worker", "--role", role, "--pool-address", self.pool_address(role),
            "--coordinator-address", self.coordinator_address,
            "--service-name", f"{role}-worker", *self.worker_args, *extra_args], env))

    def restart(self, old: ServiceProcess) -> ServiceProcess:
        """The same command again (same fixed port for control-plane services)."""
        new = ServiceProcess(old.name, old.args, None)
        new.env = old.env
        return self._start(new)


def build_stack(processes: list[ServiceProcess], redis_url: str, database_url: str, *,
                num_replicas: int = 1, num_prefill: int = 2, num_decode: int = 2,
                num_routers: int | None = None, pool_args: tuple[str, ...] = (),
                router_args: tuple[str, ...] = (),
                worker_args: tuple[str, ...] = WORKER_ARGS,
                extra_env: dict[str, str] | None = None) -> Stack:
    """Start and wait for: ``num_replicas`` coordinators and pool managers of each role,
    ``num_routers`` routers (default ``num_replicas``), then the workers; returns once every
    router sees every worker READY."""
    env = {
        "PDSERVE_REDIS_URL": redis_url, "PDSERVE_DATABASE_URL": database_url,
        "PDSERVE_LOG_FORMAT": "text", "PDSERVE_METRICS_PORT": "-1", **(extra_env or {}),
    }
    stack = Stack(processes, env, secrets.token_hex(16),
                  [free_port() for _ in range(num_replicas)],
                  [free_port() for _ in range(num_replicas)],
                  [free_port() for _ in range(num_replicas)],
                  pool_args=pool_args, router_args=router_args, worker_args=worker_args)
    for i in range(num_replicas):
        stack.coordinators.append(stack.start_coordinator(i))
        stack.prefill_pools.append(stack.start_pool("prefill", i))
        stack.decode_pools.append(stack.start_pool("decode", i))
    for process in (*stack.coordinators, *stack.prefill_pools, *stack.decode_pools):
        process.wait_ready()
    for i in range(num_routers if num_routers is not None else num_replicas):
        stack.routers.append(stack.start_router(i))
    for i in range(num_prefill):
        stack.prefill_workers.append(stack.start_worker("prefill", f"prefill-worker-{i}"))
    for i in range(num_decode):
        stack.decode_workers.append(stack.start_worker("decode", f"decode-worker-{i}"))
    for process in (*stack.routers, *stack.workers):
        process.wait_ready()
    if num_prefill or num_decode:  # else provisioned by the pool managers: the caller waits
        for router in stack.routers:
            wait_router_sees(router, num_prefill, num_decode)
    return stack


def ready_counts(router_address: str) -> tuple[int, int]:
    """(prefill, decode) workers READY in a router's view."""
    with grpc.insecure_channel(router_address) as channel:
        models = router_pb2_grpc.RouterServiceStub(channel).ListModels(
            router_pb2.ListModelsRequest(), timeout=5).models
    card = next((m for m in models if m.name == MODEL), None)
    return (card.num_prefill_workers, card.num_decode_workers) if card else (0, 0)


def list_workers(pool_address: str) -> list[pb.WorkerInfo]:
    """Workers of both roles in the shared store, as a pool manager lists them."""
    target, options = channel_target(pool_address)
    with grpc.insecure_channel(target, options=options) as channel:
        return list(pool_pb2_grpc.PoolServiceStub(channel).ListWorkers(
            pool_pb2.ListWorkersRequest(deployment=MODEL), timeout=5).workers)


def ready_in_store(pool_address: str) -> int:
    """Workers READY in the shared store, as a pool manager lists them."""
    return sum(1 for w in list_workers(pool_address) if w.state == pb.WORKER_STATE_READY)


def wait_until(probe: Callable[[], object], timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll ``probe`` (exceptions count as false) until truthy or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if probe():
                return True
        time.sleep(interval_s)
    return False


def wait_router_sees(router: ServiceProcess, num_prefill: int, num_decode: int,
                     timeout_s: float = 30.0) -> None:
    is_seen = wait_until(lambda: ready_counts(router.grpc_address) == (num_prefill, num_decode),
                         timeout_s)
    if not is_seen:
        try:
            seen = ready_counts(router.grpc_address)
        except grpc.RpcError as exc:
            seen = exc  # type: ignore[assignment]
        raise AssertionError(f"{router.name} does not see {num_prefill}/{num_decode} ready "
                             f"workers within {timeout_s:.0f}s (sees {seen})\n"
                             f"{router.describe()}")


def worker_phases(worker: ServiceProcess) -> set[str]:
    with grpc.insecure_channel(worker.grpc_address) as channel:
        status = worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
            worker_pb2.GetStatusRequest(), timeout=2)
    return {t.phase for t in status.tickets}


def catch_in_phase(workers: list[ServiceProcess], phase: str,
                   timeout_s: float = 20.0) -> ServiceProcess:
    """The first worker seen with a ticket in ``phase`` (polled as fast as GetStatus allows)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers:
            try:
                if phase in worker_phases(worker):
                    return worker
            except grpc.RpcError:
                continue
    pytest.fail(f"no worker was seen in phase {phase!r} within {timeout_s:.0f}s")


# -- load ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    request_id: str
    kind: str
    """completed, failed, truncated or hung."""
    code: str
    num_tokens: int
    num_tries: int
    started_s: float
    """time.monotonic() at the first try."""
    ended_s: float
    detail: str = ""
    num_resumes: int = 0
    """Tries that resumed the stream after some tokens (``resume_token_ids``)."""
    num_failovers: int = 0
    """Decode workers the router moved the stream off mid-way (``RequestTiming.num_failovers``)."""


def _prompt(rng: random.Random, num_tokens: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ") for _ in range(num_tokens))


class Load:
    """Closed-loop clients (``concurrency`` of them) sending requests over the router replicas
    until ``stop()``; every request's ``Outcome`` ends up in ``outcomes``."""

    def __init__(self, router_addresses: list[str], *, concurrency: int = 4,
                 prompt_tokens: tuple[int, int] = (100, 600), max_tokens: int = MAX_TOKENS,
                 seed: int = 7, pause_s: float = 0.0) -> None:
        self.router_addresses = list(router_addresses)
        self.concurrency = concurrency
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.pause_s = pause_s
        self.outcomes: list[Outcome] = []
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._channels: list[grpc.aio.Channel] = []
        self._next = 0

    def start(self) -> Load:
        self._channels = [grpc.aio.insecure_channel(a) for a in self.router_addresses]
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]
        return self

    async def stop(self) -> list[Outcome]:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        for channel in self._channels:
            await channel.close()
        return self.outcomes

    async def _client(self, index: int) -> None:
        while not self._stop.is_set():
            prompt = _prompt(self._rng, self._rng.randint(*self.prompt_tokens))
            self.outcomes.append(await self.request(prompt, f"load-{index}-{uuid.uuid4().hex[:8]}"))
            if self.pause_s:
                await asyncio.sleep(self.pause_s)

    async def request(self, prompt: str, request_id: str) -> Outcome:
        started = time.monotonic()
        try:
            return await asyncio.wait_for(self._request(prompt, request_id, started), HANG_S)
        except TimeoutError:
            return Outcome(request_id, "hung", "", 0, 0, started, time.monotonic())

    async def _request(self, prompt: str, request_id: str, started: float) -> Outcome:
        received: list[int] = []
        """Tokens of the request so far, over every try (a resumed try sends them)."""
        code = ""
        detail = ""
        tries = 0
        num_resumes = 0
        try_id = ""
        for tries in range(1, CLIENT_TRIES + 1):
            self._next += 1
            channel = self._channels[self._next % len(self._channels)]
            try_id = try_id if received else f"{request_id}-{tries}"  # a resume keeps its id
            call = router_pb2_grpc.RouterServiceStub(channel).Generate(router_pb2.GenerateRequest(
                request_id=try_id, model=MODEL, prompt=prompt, resume_token_ids=received,
                sampling=pb.SamplingParams(max_tokens=self.max_tokens)), timeout=HANG_S + 5)
            num_before = len(received)
            num_resumes += bool(received)
            last = None
            try:
                async for chunk in call:
                    received.extend(chunk.token_ids)
                    last = chunk
            except grpc.aio.AioRpcError as exc:
                code, detail = exc.code().name, exc.details() or ""
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    # Nothing answered: safe to try another replica. Tokens answered: the
                    # replica died mid-stream (or gave up failing over); resume elsewhere.
                    await asyncio.sleep(0.05 * tries if len(received) == num_before else 0.0)
                    continue
                return Outcome(request_id, "failed", code, len(received), tries, started,
                               time.monotonic(), detail, num_resumes)
            is_complete = (last is not None and len(received) == self.max_tokens
                           and last.finish_reason == pb.FINISH_REASON_LENGTH)
            num_failovers = last.timing.num_failovers if last is not None else 0
            return Outcome(request_id, "completed" if is_complete else "truncated", "",
                           len(received), tries, started, time.monotonic(), "", num_resumes,
                           num_failovers)
        return Outcome(request_id, "failed", code, len(received), tries, started,
                       time.monotonic(), detail, num_resumes)


def summary(outcomes: list[Outcome]) -> dict[str, int]:
    counts = {"completed": 0, "failed": 0, "truncated": 0, "hung": 0}
    for outcome in outcomes:
        counts[outcome.kind] += 1
    return counts


def failure_reasons(outcomes: list[Outcome]) -> dict[str, int]:
    """Failed requests by status code and the start of the message."""
    reasons: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.kind == "failed":
            key = f"{outcome.code}: {outcome.detail[:70]}"
            reasons[key] = reasons.get(key, 0) + 1
    return reasons


def assert_clean(outcomes: list[Outcome], *, max_failed: int | None = None) -> None:
    """No request hung or was truncated (and at most ``max_failed`` failed cleanly)."""
    counts = summary(outcomes)
    bad = [o for o in outcomes if o.kind in ("hung", "truncated")]
    assert not bad, f"{counts}; e.g. {bad[:3]}"
    if max_failed is not None:
        failed = [o for o in outcomes if o.kind == "failed"]
        assert len(failed) <= max_failed, f"{counts}; failures e.g. {failed[:5]}"


async def settled_audit(stack: Stack, settle_s: float = 20.0) -> AuditReport:
    """``pdserve audit`` of the stack once the load is over (repeats until clean or
    ``settle_s``): ledgers exact, checksums equal, no late write."""
    pools = [stack.pool_address("prefill"), stack.pool_address("decode")]
    return await audit(stack.coordinator_address, pools, MODEL, settle_s)


async def settled_idle_ledgers(stack: Stack, timeout_s: float = 20.0) -> list[str]:
    """Problems with the idle stack's ledgers (every block free), empty when exact."""
    from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

    deadline = time.monotonic() + timeout_s
    while True:
        problems = []
        target, options = channel_target(stack.coordinator_address)
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            ledger = await kv_transfer_pb2_grpc.KvTransferServiceStub(channel).GetLedger(
                kv_transfer_pb2.GetLedgerRequest(deployment=MODEL), timeout=10)
        for entry in ledger.entries:
            if entry.num_reserved_blocks or entry.num_held_blocks:
                problems.append(f"{entry.decode_worker_id}: {entry.num_reserved_blocks} reserved,"
                                f" {entry.num_held_blocks} held")
        if not problems or time.monotonic() >= deadline:
            return problems
        await asyncio.sleep(0.25)
