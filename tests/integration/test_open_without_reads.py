"""Opening a ticket reads no worker record: the decode worker is checked against the view its
pool manager keeps beside its block ledger, in the ledger's own step, and a prefill worker once
seen is taken as one for a few seconds. So on a Redis Cluster an open touches one slot (the
decode worker's), and a master that fails over stops only the tickets of the workers it holds.

Each test runs on the memory backend and on real Redis (a random key prefix), with the real pool
managers writing the views; the worker store is wrapped to count the records read.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from pdserve.common.clock import ManualClock
from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.types import TicketSpec, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.kv_transfer.coordinator import PREFILL_RECHECK_S, KvTransferCoordinator
from pdserve.pool.manager import Heartbeat, PoolManager, PoolPolicy, Registration
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.interfaces import StateBackend, WorkerStore
from pdserve.state.prefix_index import MemoryPrefixIndex

MODEL = "m-open"
LOAD = WorkerLoad(num_free_blocks=100, num_total_blocks=100)


class CountingWorkers:
    """A ``WorkerStore`` that counts ``get`` calls (the reads an open would make)."""

    def __init__(self, inner: WorkerStore) -> None:
        self._inner = inner
        self.num_gets = 0

    async def get(self, worker_id: str) -> WorkerRecord | None:
        self.num_gets += 1
        return await self._inner.get(worker_id)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class Cluster:
    def __init__(self, backend: StateBackend, clock: ManualClock) -> None:
        self.backend, self.clock = backend, clock
        self.decode = PoolManager(PoolPolicy(WorkerRole.DECODE, "t"), backend,
                                  MemoryPrefixIndex(), clock)
        self.prefill = PoolManager(PoolPolicy(WorkerRole.PREFILL, "t"), backend,
                                   MemoryPrefixIndex(), clock)
        self.workers = CountingWorkers(backend.workers)
        self.coordinator = KvTransferCoordinator(backend.tickets, self.workers, clock)

    async def join(self) -> None:
        await self.decode.register(Registration("d-1", MODEL, "a:1", num_total_blocks=100), "t")
        await self.decode.heartbeat(Heartbeat("d-1", WorkerState.READY, LOAD, {}))
        await self.prefill.register(Registration("p-1", MODEL, "a:2"), "t")
        await self.prefill.heartbeat(Heartbeat("p-1", WorkerState.READY, WorkerLoad()))

    async def open(self, decode: str = "d-1", prefill: str = "p-1", model: str = MODEL) -> None:
        await self.coordinator.open_ticket(TicketSpec(model, decode, prefill, 4, 30.0))


@pytest.fixture(params=["memory", "redis"])
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    url = None if request.param == "memory" else request.getfixturevalue("redis_url")
    clock = ManualClock(1000.0)
    backend = open_backend(url, clock, StateOptions(key_prefix=f"pdt-{uuid.uuid4().hex[:10]}"))
    yield Cluster(backend, clock)
    if url is not None:
        client = backend.client  # type: ignore[attr-defined]
        keys = [k async for k in client.scan_iter(match=f"{backend.keys.prefix}:*")]  # type: ignore[attr-defined]
        if keys:
            await client.delete(*keys)
    await backend.close()


async def test_an_open_reads_no_worker_record(cluster: Cluster) -> None:
    await cluster.join()
    await cluster.open()
    assert cluster.workers.num_gets == 1  # the prefill worker, seen once
    for _ in range(5):
        await cluster.open()
    assert cluster.workers.num_gets == 1
    cluster.clock.advance(PREFILL_RECHECK_S + 0.1)
    await cluster.decode.heartbeat(Heartbeat("d-1", WorkerState.READY, LOAD, {}))
    await cluster.open()
    assert cluster.workers.num_gets == 2  # checked again after a while


async def test_a_drained_or_departed_decode_worker_is_refused_without_a_read(
        cluster: Cluster) -> None:
    await cluster.join()
    await cluster.open()
    await cluster.decode.drain("d-1")
    reads = cluster.workers.num_gets
    with pytest.raises(UnavailableError, match="is draining"):
        await cluster.open()
    with pytest.raises(InvalidArgumentError, match="serves") as caught:
        await cluster.open(model="another-model")
    assert caught.value.field == "decode_worker_id"
    assert cluster.workers.num_gets == reads
    cluster.clock.advance(60.0)  # no heartbeat: the record and its view expire together
    with pytest.raises(UnavailableError, match="not in the pool"):
        await cluster.open()


async def test_bad_worker_ids_are_still_named(cluster: Cluster) -> None:
    await cluster.join()
    with pytest.raises(InvalidArgumentError) as caught:
        await cluster.open(decode="p-1")  # a prefill worker has no block ledger
    assert caught.value.field == "decode_worker_id"
    with pytest.raises(InvalidArgumentError) as caught:
        await cluster.open(prefill="d-1")
    assert caught.value.field == "prefill_worker_id"
    with pytest.raises(UnavailableError, match="not in the pool"):
        await cluster.open(decode="d-never")
    with pytest.raises(UnavailableError, match="not in the pool"):
        await cluster.open(prefill="p-never")


async def test_a_ledger_without_a_view_falls_back_to_the_record(cluster: Cluster) -> None:
    """A pool manager of an earlier release writes no view: the record is read, as before."""
    await cluster.join()
    await cluster.open()  # the prefill worker is known from here on
    await cluster.backend.tickets.drop_worker("d-1")
    await cluster.backend.tickets.set_capacity("d-1", 100)  # as an earlier release does
    reads = cluster.workers.num_gets
    await cluster.open()
    assert cluster.workers.num_gets == reads + 1
    await cluster.backend.workers.set_state("d-1", WorkerState.DRAINING)  # no view written
    with pytest.raises(UnavailableError, match="is draining"):
        await cluster.open()


async def test_every_heartbeat_keeps_the_view_alive(cluster: Cluster) -> None:
    """A decode heartbeat that carries no block report (a worker still loading reports no
    capacity) extends the view with the record, or the worker would expire for opens only."""
    await cluster.join()
    ttl_s = cluster.decode.policy.record_ttl_s
    for _ in range(3):
        cluster.clock.advance(ttl_s * 0.75)
        await cluster.decode.heartbeat(Heartbeat("d-1", WorkerState.READY, WorkerLoad()))
        await cluster.prefill.heartbeat(Heartbeat("p-1", WorkerState.READY, WorkerLoad()))
    await cluster.open()
