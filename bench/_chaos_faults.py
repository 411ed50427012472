"""The chaos harness's faults and its run: steady open-loop load, faults injected one after the
other in a seeded random order (worker kills caught in a chosen phase), killed processes
restarted after a delay as a supervisor would, Postgres taken down for a while in the
background, an optional drain-correct scale-down at the end, then the settle checks.

Faults (``FAULTS``):

- ``kill_prefill_prefilling``, ``kill_prefill_sending``, ``kill_decode_decoding``: kill -9 of a
  worker caught (GetStatus) with a ticket in that phase;
- ``kill_coordinator``, ``kill_prefill_pool``, ``kill_decode_pool``, ``kill_router``: kill -9 of
  one replica (restarted on its port);
- ``kill_governor``: kill -9 of the active governor (the lease holder); the standby takes over;
- ``redis_restart``: every soft-state key gone; nothing else restarted; on a Redis Cluster
  (``ChaosConfig.state``), kill -9 of a random master instead: its replica takes over (what the
  master had not replicated is lost) and the node rejoins as a replica;
- ``redis_failover`` (Redis Cluster only): a graceful ``CLUSTER FAILOVER`` of a random master;
- ``stall_transfer``: SIGSTOP of the clock-skewed prefill worker (when there is one) caught while
  sending KV, for three ticket leases, then SIGCONT: its socket freezes mid-transfer, the lease
  lapses on the coordinator's clock, the request is retried, its late frames must not land;
- ``stall_prefill_loop``: the prefill loop of a live prefill worker held (SIGUSR1, as a hung
  engine would hold it; its heartbeats go on, so it stays READY) for the stall bound plus three
  leases, then released (SIGUSR2): its queued prompts' leases stop being renewed, the
  coordinator expires them and the router retries the requests elsewhere;
- ``rolling_restart``: every process of the stack replaced one at a time, as a rolling update
  does (SIGTERM, the same command again in its slot, full strength again and a heartbeat
  timeout more before the next):
  coordinators, pool managers, routers (their clients resume elsewhere), governors, then the
  workers (a decode worker's streams fail over);
- ``postgres_down`` (background, overlapping the others): PostgreSQL stopped for a while;
  durable records spool and must all be written when it returns.

Which failures are allowed: none. A failure before the first token is retried on other
workers; a stream whose decode worker dies fails over to another one (the router re-prefills the
prompt and the tokens delivered); a stream whose router replica dies is resumed by the client on
another replica (``resume_token_ids``). Streams still cut after their first token while a fault
that kills their decode worker or router struck (``FaultRecord.may_cut_streams``) are reported
apart, as ``failed_cut_after_first_token``, and count as a problem.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from _chaos_load import Counts, OpenLoopLoad, is_refused, overlapping
from _chaos_stack import (
    ChaosStack,
    FencingMonitor,
    HarnessFailure,
    catch_in_phase,
    log,
)
from e2e.faults import (
    MODEL,
    Outcome,
    kill9,
    list_workers,
    settled_audit,
    settled_idle_ledgers,
    wait_until,
)

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, pool_pb2, pool_pb2_grpc
from pdserve.cli.audit import AuditReport, audit
from pdserve.common.grpc_client import channel_target
from pdserve.db.durable import SPOOL_SUFFIX

WORKER_FAULTS = ("kill_prefill_prefilling", "kill_prefill_sending", "kill_decode_decoding")
CONTROL_PLANE_FAULTS = ("kill_coordinator", "kill_prefill_pool", "kill_decode_pool",
                        "kill_router", "kill_governor")
FAULTS = (*WORKER_FAULTS, *CONTROL_PLANE_FAULTS, "redis_restart", "stall_transfer",
          "stall_prefill_loop", "rolling_restart")
CLUSTER_FAULTS = (*FAULTS, "redis_failover")
"""On ``--state redis-cluster``: ``redis_restart`` is a master's crash, and a graceful failover
of another joins the list."""
STATES = ("redis", "redis-cluster")


def faults_for(state: str) -> tuple[str, ...]:
    return CLUSTER_FAULTS if state == "redis-cluster" else FAULTS
CUTTING_FAULTS = frozenset({"kill_decode_decoding", "kill_router", "rolling_restart"})
"""Faults that kill what carries streams past their first token (failover and client resume
should keep every one of those streams whole)."""


@dataclass(frozen=True, slots=True)
class ChaosPlan:
    """How long, how hard and which faults. Durations in seconds."""

    rate_rps: float = 6.0
    faults: tuple[str, ...] = FAULTS
    """One round; every round runs them all, in a new seeded random order."""
    min_rounds: int = 1
    min_accepted: int = 1000
    """Rounds go on (one fault at a time) until this many requests were accepted."""
    max_duration_s: float = 400.0
    """...or until this long has passed since the load began (after at least one round)."""
    warmup_s: float = 3.0
    gap_s: tuple[float, float] = (1.0, 4.0)
    """Calm between a recovery and the next fault."""
    restart_delay_s: tuple[float, float] = (1.0, 4.0)
    """The supervisor's delay before restarting a killed process (after the pools saw it
    fail, for a worker)."""
    postgres_down_s: float = 60.0
    """0 = Postgres stays up."""
    scale_down_hold_s: float = 0.0
    """0 = no scale-down; else halve each pool under load and serve this long on the halves."""
    prompt_tokens: tuple[int, int] = (100, 1500)
    max_tokens: int = 32
    seed: int = 1


@dataclass(slots=True)
class FaultRecord:
    """One injected fault. Times are time.monotonic()."""

    name: str
    victim: str = ""
    injected_s: float = 0.0
    recovered_s: float = 0.0
    """Back to full strength (every router sees every worker READY); 0 = never."""
    details: dict[str, float | int | str] = field(default_factory=dict)
    error: str = ""
    """Why the fault could not be injected, or the stack did not recover."""

    @property
    def may_cut_streams(self) -> bool:
        return self.name in CUTTING_FAULTS

    @property
    def recovery_s(self) -> float:
        return self.recovered_s - self.injected_s if self.recovered_s else float("nan")


@dataclass(slots=True)
class ChaosResult:
    outcomes: list[Outcome]
    faults: list[FaultRecord]
    started_s: float
    ended_s: float
    audit: AuditReport | None = None
    idle_ledger_problems: list[str] = field(default_factory=list)
    leaked_blocks: int = 0
    late_writes_accepted: int = 0
    refused_frames: int = 0
    num_checksums_compared: int = 0
    """Handoffs whose sent and accepted KV checksums were both seen (through the run)."""
    checksum_mismatches: list[str] = field(default_factory=list)
    orphaned_tickets: list[str] = field(default_factory=list)
    """Tickets still open, or DONE and holding blocks, once the stack is idle."""
    scale_down: FaultRecord | None = None
    unexpected_failures: list[Outcome] = field(default_factory=list)
    expected_failures: list[Outcome] = field(default_factory=list)

    @property
    def counts(self) -> Counts:
        return Counts.of(self.outcomes)

    def fault(self, name: str) -> FaultRecord | None:
        return next((f for f in self.faults if f.name == name and not f.error), None)

    @property
    def failed_during_scale_down(self) -> int:
        if self.scale_down is None or not self.scale_down.injected_s:
            return -1
        end = self.scale_down.recovered_s or self.ended_s
        return sum(o.kind == "failed" and not is_refused(o)
                   for o in overlapping(self.outcomes, self.scale_down.injected_s, end))


# -- faults -------------------------------------------------------------------------------------


class Injector:
    """Runs faults on one stack under one load, one at a time (the Postgres outage aside)."""

    def __init__(self, stack: ChaosStack, load: OpenLoopLoad, plan: ChaosPlan,
                 rng: random.Random) -> None:
        self.stack = stack
        self.load = load
        self.plan = plan
        self.rng = rng

    async def inject(self, name: str) -> FaultRecord:
        record = FaultRecord(name)
        log(f"fault {name}")
        try:
            if name in WORKER_FAULTS:
                _, role, phase = name.split("_")
                await self._kill_worker(record, role, phase)
            elif name == "kill_governor":
                await self._kill_governor(record)
            elif name in CONTROL_PLANE_FAULTS:
                await self._kill_replica(record, name.removeprefix("kill_"))
            elif name == "redis_restart" and self.stack.cluster is not None:
                await self._fail_over_redis(record, crash=True)
            elif name == "redis_restart":
                await self._restart_redis(record)
            elif name == "redis_failover":
                await self._fail_over_redis(record, crash=False)
            elif name == "stall_transfer":
                await self._stall_transfer(record)
            elif name == "stall_prefill_loop":
                await self._stall_prefill_loop(record)
            elif name == "rolling_restart":
                await self._rolling_restart(record)
            elif name == "postgres_down":
                await self._postgres_down(record)
            else:
                raise ValueError(f"unknown fault {name!r}")
        except HarnessFailure as exc:
            # What failed (the first line) and what the process printed last: a restarted
            # process that exits says why in its last lines.
            first, *rest = str(exc).splitlines() or [""]
            record.error = "\n".join([f"{type(exc).__name__}: {first[:300]}", *rest[-25:]])
        if not record.error and not record.recovered_s and name != "kill_governor":
            record.error = "the stack did not return to full strength"
        log(f"  {name}: victim {record.victim or '-'}, recovered after {record.recovery_s:.1f}s "
            f"{record.details} {record.error}")
        return record

    def _delay(self) -> float:
        return self.rng.uniform(*self.plan.restart_delay_s)

    async def _recover(self, record: FaultRecord, timeout_s: float = 60.0) -> None:
        if await asyncio.to_thread(self.stack.wait_full_strength, timeout_s):
            record.recovered_s = time.monotonic()

    async def _kill_worker(self, record: FaultRecord, role: str, phase: str) -> None:
        services = self.stack.services
        group = services.prefill_workers if role == "prefill" else services.decode_workers
        victim = await catch_in_phase(group, phase)
        if victim is None:
            record.error = f"no {role} worker was seen {phase} within 20s"
            return
        os.killpg(victim.pid, signal.SIGKILL)
        record.injected_s = time.monotonic()
        record.victim = f"{victim.name} ({victim.worker_id[:10]})"
        await asyncio.to_thread(kill9, victim)  # reaps it
        # A supervisor notices the death; the pools notice the missed heartbeats.
        is_failed = await asyncio.to_thread(self._wait_not_ready, role, victim.worker_id, 30.0)
        record.details["detected_s"] = round(time.monotonic() - record.injected_s, 2)
        if not is_failed:
            record.error = "the pools still list the killed worker READY after 30s"
        await asyncio.sleep(self._delay())
        await asyncio.to_thread(self.stack.restart, victim)
        await self._recover(record)

    def _wait_not_ready(self, role: str, worker_id: str, timeout_s: float) -> bool:
        def gone() -> bool:
            return not any(w.worker_id == worker_id and w.state == pb.WORKER_STATE_READY
                           for w in list_workers(self.stack.services.pool_address(role)))
        return wait_until(gone, timeout_s, 0.1)

    async def _kill_replica(self, record: FaultRecord, kind: str) -> None:
        services = self.stack.services
        group = {"coordinator": services.coordinators, "prefill_pool": services.prefill_pools,
                 "decode_pool": services.decode_pools, "router": services.routers}[kind]
        victim = group[self.rng.randrange(len(group))]
        record.victim = victim.name
        record.injected_s = time.monotonic()
        await asyncio.to_thread(kill9, victim)
        await asyncio.sleep(self._delay())
        await asyncio.to_thread(self.stack.restart, victim)
        await self._recover(record)

    async def _kill_governor(self, record: FaultRecord) -> None:
        governors = self.stack.governors
        if len(governors) < 2:
            record.error = "fewer than two governors"
            return
        if not await asyncio.to_thread(
                wait_until, lambda: self.stack.governor_holder_pid() is not None, 30.0):
            record.error = "no governor holds the lease"
            return
        holder = self.stack.governor_holder_pid()
        victim = next((g for g in governors if g.pid == holder), None)
        if victim is None:
            record.error = f"the lease holder (pid {holder}) is not one of ours"
            return
        others = {g.pid for g in governors if g is not victim}
        record.victim = victim.name
        record.injected_s = time.monotonic()
        await asyncio.to_thread(kill9, victim)
        lease_s = self.stack.config.governor_lease_s
        taken = await asyncio.to_thread(
            wait_until, lambda: self.stack.governor_holder_pid() in others, 10 * lease_s, 0.05)
        if taken:
            record.details["takeover_s"] = round(time.monotonic() - record.injected_s, 2)
            record.recovered_s = time.monotonic()
        else:
            record.error = f"no standby took the lease within {10 * lease_s:.0f}s"
        await asyncio.sleep(self._delay())
        await asyncio.to_thread(self.stack.restart, victim)

    async def _restart_redis(self, record: FaultRecord) -> None:
        redis_server = self.stack.redis
        assert redis_server is not None
        record.victim = "redis"
        record.injected_s = time.monotonic()
        await asyncio.to_thread(redis_server.restart)
        back = time.monotonic()
        record.details["down_s"] = round(back - record.injected_s, 2)
        first_success = asyncio.create_task(self.load.wait_for_success_after(back))
        # The store starts empty: READY there means re-registered from heartbeats; the routers'
        # views are checked as well (they resync from the store).
        expected = dict(zip(("prefill", "decode"), self.stack.expected_counts(), strict=True))
        if await asyncio.to_thread(wait_until, lambda: (
                self.stack.ready_in_pools() == expected and self.stack.is_full_strength()),
                60.0, 0.05):
            record.recovered_s = time.monotonic()
            record.details["all_ready_s"] = round(record.recovered_s - back, 2)
        success_s = await first_success
        if success_s is None:
            record.error = "no request started after the restart completed within 60s"
        else:
            record.details["first_success_s"] = round(success_s, 2)

    async def _fail_over_redis(self, record: FaultRecord, *, crash: bool) -> None:
        cluster = self.stack.cluster
        if cluster is None:
            record.error = "needs a Redis Cluster (--state redis-cluster)"
            return
        masters = await asyncio.to_thread(cluster.master_ports)
        victim = masters[self.rng.randrange(len(masters))]
        record.victim = f"redis master :{victim}"
        record.injected_s = time.monotonic()
        if crash:
            promoted = await asyncio.to_thread(cluster.crash, victim, self._delay())
        else:
            promoted = await asyncio.to_thread(cluster.fail_over, victim)
        back = time.monotonic()
        record.details["new_master"] = promoted
        record.details["failover_s"] = round(back - record.injected_s, 2)
        success_s = await self.load.wait_for_success_after(back)
        if success_s is None:
            record.error = "no request started after the failover completed within 60s"
            return
        record.details["first_success_s"] = round(success_s, 2)
        await self._recover(record)

    async def _stall_transfer(self, record: FaultRecord) -> None:
        services = self.stack.services
        skewed = [w for w in services.prefill_workers if w.name in self.stack.skewed]
        victim = await catch_in_phase(skewed or services.prefill_workers, "sending")
        if victim is None and skewed:
            victim = await catch_in_phase(services.prefill_workers, "sending")
        if victim is None:
            record.error = "no prefill worker was seen sending within 20s"
            return
        os.killpg(victim.pid, signal.SIGSTOP)
        record.injected_s = time.monotonic()
        record.victim = f"{victim.name} ({victim.worker_id[:10]})"
        record.details["is_skewed"] = int(victim.name in self.stack.skewed)
        try:
            await asyncio.sleep(3 * self.stack.config.lease_s)
        finally:
            os.killpg(victim.pid, signal.SIGCONT)
        record.details["frozen_s"] = round(time.monotonic() - record.injected_s, 2)
        await self._recover(record)  # the resumed worker is taken back

    async def _stall_prefill_loop(self, record: FaultRecord) -> None:
        services = self.stack.services
        victim = await catch_in_phase(services.prefill_workers, "prefilling")
        if victim is None:
            victim = services.prefill_workers[self.rng.randrange(len(services.prefill_workers))]
        os.kill(victim.pid, signal.SIGUSR1)
        record.injected_s = time.monotonic()
        record.victim = f"{victim.name} ({victim.worker_id[:10]})"
        try:
            await asyncio.sleep(self.stack.config.max_prefill_stall_s
                                + 3 * self.stack.config.lease_s)
        finally:
            os.kill(victim.pid, signal.SIGUSR2)
        record.details["held_s"] = round(time.monotonic() - record.injected_s, 2)
        if "prefill loop stalled" not in victim.output:
            record.error = "the worker never said its prefill loop stalled"
            return
        await self._recover(record)

    async def _rolling_restart(self, record: FaultRecord) -> None:
        stack = self.stack
        services = stack.services
        order = [*services.coordinators, *services.prefill_pools, *services.decode_pools,
                 *services.routers, *stack.governors, *services.prefill_workers,
                 *services.decode_workers]
        record.victim = f"all {len(order)} processes"
        record.injected_s = time.monotonic()
        # As a rolling update's minReadySeconds: a replacement serves a while before the next
        # process goes (its peers' channels and the workers' heartbeats find it meanwhile).
        dwell_s = stack.config.heartbeat_timeout_s + 1.0
        for old in order:
            await asyncio.to_thread(old.stop)  # SIGTERM: a graceful exit
            await asyncio.to_thread(stack.restart, old)
            if not await asyncio.to_thread(stack.wait_full_strength, 60.0):
                record.error = f"not back to full strength 60 s after replacing {old.name}"
                return
            await asyncio.sleep(dwell_s)
        record.details["num_replaced"] = len(order)
        record.recovered_s = time.monotonic()

    async def _postgres_down(self, record: FaultRecord) -> None:
        postgres = self.stack.postgres
        if postgres is None:
            record.error = "no private PostgreSQL"
            return
        record.victim = "postgres"
        record.injected_s = time.monotonic()
        await asyncio.to_thread(postgres.stop)
        await asyncio.sleep(self.plan.postgres_down_s)
        done = await asyncio.to_thread(_remote_done_ticket_ids, self.stack)
        spooled = [p.stat().st_size for p in self.stack.spool_dir.rglob(f"*{SPOOL_SUFFIX}")]
        record.details["spooled_bytes"] = sum(spooled)
        await asyncio.to_thread(postgres.start)
        back = time.monotonic()
        record.details["down_s"] = round(back - record.injected_s, 1)
        drained = await asyncio.to_thread(_wait_spools_drained, self.stack, 60.0)
        record.details["spool_drain_s"] = round(time.monotonic() - back, 1) if drained else -1
        missing = await asyncio.to_thread(_missing_transfer_stats, self.stack, done, 30.0)
        record.details["handoffs_checked"] = len(done)
        record.details["records_lost"] = len(missing)
        if drained:
            record.recovered_s = time.monotonic()
        else:
            record.error = "spools not drained within 60s of the database's return"


def _remote_done_ticket_ids(stack: ChaosStack) -> set[str]:
    target, options = channel_target(stack.services.coordinator_address)
    with grpc.insecure_channel(target, options=options) as channel:
        tickets = kv_transfer_pb2_grpc.KvTransferServiceStub(channel).ListTickets(
            kv_transfer_pb2.ListTicketsRequest(state=pb.TICKET_STATE_DONE, limit=100_000),
            timeout=10).tickets
    return {t.token.ticket_id for t in tickets if t.prefill_worker_id}


def _wait_spools_drained(stack: ChaosStack, timeout_s: float) -> bool:
    return wait_until(lambda: all(p.stat().st_size == 0 for p in
                                  stack.spool_dir.rglob(f"*{SPOOL_SUFFIX}")), timeout_s, 0.5)


def _missing_transfer_stats(stack: ChaosStack, ticket_ids: set[str], timeout_s: float
                            ) -> set[str]:
    """Of ``ticket_ids`` (remote handoffs done while the database was down), those with no
    transfer statistics in it after up to ``timeout_s``."""
    from pdserve.db.repository import Repository

    repository = Repository.from_url(stack.database_url)
    try:
        def missing() -> set[str]:
            recorded = {r.ticket_id for r in repository.list_transfer_stats(MODEL, 10_000)}
            return ticket_ids - recorded

        wait_until(lambda: not missing(), timeout_s, 0.5)
        return missing()
    finally:
        repository.close()


# -- scale-down ---------------------------------------------------------------------------------


def _set_target(stack: ChaosStack, role: str, num_workers: int) -> None:
    target, options = channel_target(stack.services.pool_address(role))
    with grpc.insecure_channel(target, options=options) as channel:
        pool_pb2_grpc.PoolServiceStub(channel).SetTargetSize(pool_pb2.SetTargetSizeRequest(
            deployment=MODEL, num_workers=num_workers, set_by="governor",
            role=pb.WORKER_ROLE_PREFILL if role == "prefill" else pb.WORKER_ROLE_DECODE),
            timeout=10)


async def scale_down(stack: ChaosStack, hold_s: float) -> FaultRecord:
    """Halve each pool under load through the pool managers' SetTargetSize (the governor's
    path); done when only the kept workers are listed and all of them are READY."""
    record = FaultRecord("scale_down", victim="half of each pool")
    num_prefill, num_decode = stack.expected_counts()
    keep = {"prefill": max(1, num_prefill // 2), "decode": max(1, num_decode // 2)}
    log(f"scale-down: {num_prefill}+{num_decode} -> {keep['prefill']}+{keep['decode']}")
    record.injected_s = time.monotonic()
    for role, num in keep.items():
        await asyncio.to_thread(_set_target, stack, role, num)

    def is_halved() -> bool:
        # Drained workers leave the store; records of workers killed earlier stay FAILED
        # until they expire and do not count.
        live = [w for w in list_workers(stack.services.pool_address("decode"))
                if w.state != pb.WORKER_STATE_FAILED]
        return len(live) == sum(keep.values()) and stack.ready_in_pools() == keep

    if await asyncio.to_thread(wait_until, is_halved, 90.0, 0.25):
        record.details["drain_s"] = round(time.monotonic() - record.injected_s, 1)
        await asyncio.sleep(hold_s)  # serve on the halved pools
        record.recovered_s = time.monotonic()
    else:
        record.error = f"pools not halved within 90s: {stack.ready_in_pools()}"
    for group in (stack.services.prefill_workers, stack.services.decode_workers):
        group[:] = [w for w in group if w.returncode is None]  # the drained ones left
    return record


# -- the run ------------------------------------------------------------------------------------


def classify_failures(outcomes: list[Outcome], faults: list[FaultRecord]
                      ) -> tuple[list[Outcome], list[Outcome]]:
    """(expected, unexpected) accepted failures: a failure is expected only if the stream had
    its first token and a fault that may cut streams struck while it ran."""
    cutting = [f.injected_s for f in faults if f.may_cut_streams and f.injected_s]
    expected, unexpected = [], []
    for outcome in outcomes:
        if outcome.kind != "failed" or is_refused(outcome):
            continue
        is_cut = outcome.num_tokens > 0 and any(
            outcome.started_s <= t <= outcome.ended_s for t in cutting)
        (expected if is_cut else unexpected).append(outcome)
    return expected, unexpected


async def run_chaos(stack: ChaosStack, plan: ChaosPlan) -> ChaosResult:
    """Load, faults, optional scale-down, then the settle checks (audit, idle ledgers, fencing
    counters)."""
    rng = random.Random(plan.seed)
    monitor = FencingMonitor(stack).start()
    load = OpenLoopLoad(stack.services.router_addresses, plan.rate_rps,
                        prompt_tokens=plan.prompt_tokens, max_tokens=plan.max_tokens,
                        seed=plan.seed).start()
    started = time.monotonic()
    injector = Injector(stack, load, plan, rng)
    faults: list[FaultRecord] = []
    progress = asyncio.create_task(_progress(load, started))
    await asyncio.sleep(plan.warmup_s)

    background: asyncio.Task[FaultRecord] | None = None
    if plan.postgres_down_s > 0:
        async def outage() -> FaultRecord:
            await asyncio.sleep(rng.uniform(0.0, 10.0))
            return await injector.inject("postgres_down")
        background = asyncio.create_task(outage())

    num_rounds = 0
    while True:
        order = list(plan.faults)
        rng.shuffle(order)
        for name in order:
            await asyncio.sleep(rng.uniform(*plan.gap_s))
            faults.append(await injector.inject(name))
            if num_rounds >= plan.min_rounds and _is_enough(load, plan, started):
                break  # past the rounds asked for: one fault at a time until enough
        num_rounds += 1
        if num_rounds >= plan.min_rounds and _is_enough(load, plan, started):
            break
    while Counts.of(load.outcomes).accepted < plan.min_accepted \
            and time.monotonic() - started < plan.max_duration_s:
        await asyncio.sleep(1.0)  # enough faults: serve on until enough requests
    if background is not None:
        faults.append(await background)

    scale_down_record = None
    if plan.scale_down_hold_s > 0:
        await asyncio.sleep(rng.uniform(*plan.gap_s))
        scale_down_record = await scale_down(stack, plan.scale_down_hold_s)
    log("stopping the load")
    outcomes = await load.stop()
    ended = time.monotonic()
    progress.cancel()
    result = ChaosResult(outcomes, faults, started, ended, scale_down=scale_down_record)
    await _settle(stack, monitor, result)
    result.expected_failures, result.unexpected_failures = classify_failures(outcomes, faults)
    return result


def _is_enough(load: OpenLoopLoad, plan: ChaosPlan, started: float) -> bool:
    if time.monotonic() - started >= plan.max_duration_s:
        return True
    return Counts.of(load.outcomes).accepted >= plan.min_accepted


async def _progress(load: OpenLoopLoad, started: float, period_s: float = 10.0) -> None:
    while True:
        await asyncio.sleep(period_s)
        c = Counts.of(load.outcomes)
        log(f"{time.monotonic() - started:5.0f}s: sent {load.num_sent}, accepted {c.accepted}, "
            f"completed {c.completed}, failed {c.failed_clean}, hung {c.hung}, "
            f"truncated {c.truncated}, in flight {load.num_in_flight}")


async def _settle(stack: ChaosStack, monitor: FencingMonitor, result: ChaosResult) -> None:
    """Once idle: the audit (ledgers vs workers' tables, checksums, late writes) until clean,
    every ledger free, then every block still in use anywhere counts as leaked."""
    log("settling: pdserve audit")
    services = stack.services
    result.audit = await settled_audit(services, settle_s=30.0)
    result.idle_ledger_problems = await settled_idle_ledgers(services, timeout_s=30.0)
    final = await audit(
        services.coordinator_address,
        [services.pool_address("prefill"), services.pool_address("decode")],
        MODEL,
        0.0,
    )
    result.leaked_blocks = (sum(max(d.ledger_used_blocks, d.worker_used_blocks)
                                for d in final.decode)
                            + sum(final.prefill_blocks_in_use.values()))
    await monitor.stop()
    result.late_writes_accepted = max(monitor.num_late_writes_accepted,
                                      final.late_writes_accepted,
                                      result.audit.late_writes_accepted)
    result.refused_frames = monitor.num_refused_frames
    result.num_checksums_compared = max(monitor.num_checksums_compared,
                                        result.audit.num_checksums_compared)
    result.checksum_mismatches = sorted(set(monitor.checksum_mismatches)
                                        | set(result.audit.checksum_mismatches))
    result.orphaned_tickets = await asyncio.to_thread(_orphaned_tickets, stack)


def _orphaned_tickets(stack: ChaosStack) -> list[str]:
    target, options = channel_target(stack.services.coordinator_address)
    with grpc.insecure_channel(target, options=options) as channel:
        tickets = kv_transfer_pb2_grpc.KvTransferServiceStub(channel).ListTickets(
            kv_transfer_pb2.ListTicketsRequest(limit=100_000), timeout=10).tickets
    still_open = (pb.TICKET_STATE_OPEN, pb.TICKET_STATE_PREFILLING, pb.TICKET_STATE_TRANSFERRING)
    return [f"{t.token.ticket_id} {pb.TicketState.Name(t.state)}" for t in tickets
            if t.state in still_open or (t.state == pb.TICKET_STATE_DONE and t.is_held)]


def has_problems(result: ChaosResult) -> bool:
    """Any must-be-zero figure that is not, or a fault that could not be injected."""
    c = result.counts
    return bool(c.hung or c.truncated or c.duplicated or c.client_errors
                or result.unexpected_failures
                or result.expected_failures
                or result.leaked_blocks or result.late_writes_accepted or result.orphaned_tickets
                or result.checksum_mismatches or result.idle_ledger_problems
                or result.audit is None or not result.audit.is_ok
                or result.failed_during_scale_down > 0
                or any(f.error for f in result.faults))


def save_logs(stack: ChaosStack, logs_dir: str) -> Path:
    """Every process's captured output, one file per process (restarts numbered by pid)."""
    folder = Path(logs_dir) if logs_dir else Path(tempfile.mkdtemp(prefix="pdserve-chaos-logs-"))
    folder.mkdir(parents=True, exist_ok=True)
    for process in stack.processes:
        (folder / f"{process.name}-{process.pid}.log").write_text(process.output + "\n")
    return folder
