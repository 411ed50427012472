"""A decode worker that missed its DropTicket (the coordinator could not reach it, or could not
read its record during a state-store failover) still holds the ticket's blocks, which the ledger
has freed. Its next heartbeat is reconciled: the pool names the ticket in ``drop_tokens`` and the
worker drops it, so the two agree again without anyone retrying the lost call. And a prefix delta
lost with a failed heartbeat is sent whole with the next one. Real gRPC between the worker and its
pool."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from pdserve.common.errors import UnavailableError
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.types import (
    FencingToken,
    TicketSpec,
    TicketState,
    WorkerRole,
    WorkerState,
)
from pdserve.pool.app import PoolApp
from pdserve.pool.settings import PoolSettings
from pdserve.state.stores import Stores, open_stores
from pdserve.worker.process import WorkerProcess
from pdserve.worker.settings import WorkerSettings

MODEL = "llama-3.1-8b"
JOIN_TOKEN = "join-" + "j" * 27


@contextlib.asynccontextmanager
async def _worker_and_pool(role: WorkerRole, worker_id: str) -> AsyncIterator[
        tuple[WorkerProcess, Stores]]:
    """A started worker of ``role``, READY, registered with its pool over real gRPC."""
    stores = open_stores("memory://")
    server = GrpcServer.from_settings(CommonSettings(metrics_port=-1, grace_period_s=0.0))
    pool = PoolApp(PoolSettings(role=role, join_token=JOIN_TOKEN, deployments=(MODEL,)),
                   stores.backend, stores.prefix_index, time.time)
    pool.register(server)
    address = f"127.0.0.1:{await server.start()}"
    await pool.start()
    worker = WorkerProcess(WorkerSettings(
        role=role, deployment=MODEL, model=MODEL, worker_id=worker_id,
        pool_address=address, coordinator_address=address, join_token=JOIN_TOKEN,
        speedup=1e4, max_num_blocks=64, num_kv_layers=2, metrics_port=-1, grace_period_s=0.0))
    try:
        await worker.start()
        worker.agent.state = WorkerState.READY
        yield worker, stores
    finally:
        await worker.close()
        await server.stop(0)
        await pool.close()


async def test_a_ticket_the_ledger_freed_is_dropped_at_the_workers_next_heartbeat() -> None:
    async with _worker_and_pool(WorkerRole.DECODE, "d-1") as (worker, stores):
        tickets = stores.backend.tickets
        await worker.heartbeat()  # the ledger learns the worker's blocks
        kept = await tickets.open(TicketSpec(MODEL, "d-1", "p-1", 4, 30.0, num_prompt_tokens=40))
        freed = await tickets.open(TicketSpec(MODEL, "d-1", "p-1", 4, 30.0, num_prompt_tokens=40))
        for ticket in (kept, freed):
            worker.agent.admit(ticket.token, 40, 4)
        await worker.heartbeat()
        assert set(worker.agent.held_blocks()) == {str(kept.token), str(freed.token)}
        free_before = worker.agent.load().num_free_blocks

        dropped: list[tuple[str, str]] = []
        drop = worker.agent.drop

        def recording_drop(token: FencingToken, reason: str) -> int:
            dropped.append((str(token), reason))
            return drop(token, reason)

        worker.agent.drop = recording_drop  # type: ignore[method-assign]

        # Aborted at the ledger; the DropTicket that would have told the worker never came.
        await tickets.transition(freed.token, TicketState.ABORTED, "router gave up")
        await worker.heartbeat()
        assert set(worker.agent.held_blocks()) == {str(kept.token)}
        assert worker.agent.load().num_free_blocks == free_before + 4
        snapshot = await tickets.snapshot("d-1")
        assert snapshot.num_reserved_blocks + snapshot.num_held_blocks == 4
        # The worker drops it for the cause DropTicket would have given ("<state>: <reason>").
        assert dropped == [(str(freed.token), "aborted: router gave up")]

        await worker.heartbeat()  # nothing more to drop: the live ticket stays
        assert set(worker.agent.held_blocks()) == {str(kept.token)}

        # Expired, and released after it was done: each dropped for its own cause.
        lapsed = await tickets.open(TicketSpec(MODEL, "d-1", "p-1", 4, 30.0,
                                               num_prompt_tokens=40))
        worker.agent.admit(lapsed.token, 40, 4)
        await worker.heartbeat()
        await tickets.transition(lapsed.token, TicketState.EXPIRED, "lease lapsed")
        await tickets.hold_done(kept.token)
        await tickets.release(kept.token)
        dropped.clear()
        await worker.heartbeat()
        assert sorted(dropped) == sorted([(str(lapsed.token), "expired: lease lapsed"),
                                          (str(kept.token), "released")])
        assert not worker.agent.held_blocks()


class _FailingOnce:
    """The worker's pool client, failing its next heartbeat UNAVAILABLE (a store failover)."""

    def __init__(self, pool: object) -> None:
        self._pool = pool
        self.is_failing = True
        self.full_reports: list[bool] = []

    async def heartbeat(self, *args: object) -> object:
        self.full_reports.append(bool(args[6]))
        if self.is_failing:
            self.is_failing = False
            raise UnavailableError("state store unavailable (ConnectionError)")
        return await self._pool.heartbeat(*args)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._pool, name)


async def test_a_prefix_delta_lost_with_a_failed_heartbeat_is_sent_whole_next_time() -> None:
    async with _worker_and_pool(WorkerRole.PREFILL, "p-1") as (worker, stores):
        await worker.heartbeat()  # the first report is a full one
        worker.agent.take_prefix_delta = lambda: ([101, 102], [])  # type: ignore[method-assign]
        flaky = _FailingOnce(worker.pool)
        worker.pool = flaky  # type: ignore[assignment]
        with pytest.raises(UnavailableError):
            await worker.heartbeat()  # the delta [101, 102] is lost with it
        worker.agent.all_prefix_hashes = lambda: [101, 102]  # type: ignore[method-assign]
        await worker.heartbeat()
        assert flaky.full_reports == [False, True]
        assert await stores.prefix_index.overlap(MODEL, ["p-1"], [101, 102]) == {"p-1": 2}
