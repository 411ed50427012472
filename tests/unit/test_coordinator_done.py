"""A DONE report whose first answer was lost: the coordinator records the transfer's statistics
again (the durable store keeps one row per ticket and attempt), so a replica that died after
holding the ticket's blocks, before the record was safe, loses nothing; metrics count it once."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from pdserve.common.clock import ManualClock
from pdserve.common.errors import InvalidArgumentError, UnavailableError
from pdserve.common.types import (
    TicketSpec,
    TicketState,
    TransferRecord,
    WorkerLoad,
    WorkerRole,
    WorkerState,
)
from pdserve.kv_transfer.coordinator import KvTransferCoordinator
from pdserve.pool.manager import Heartbeat, PoolManager, PoolPolicy, Registration
from pdserve.state.factory import StateOptions
from pdserve.state.memory.backend import MemoryStateBackend
from pdserve.state.prefix_index import MemoryPrefixIndex


class RecordingSink:
    def __init__(self) -> None:
        self.records: list[TransferRecord] = []
        self.num_waits = 0

    def record(self, record: TransferRecord) -> None:
        self.records.append(record)

    async def spooled(self) -> None:
        self.num_waits += 1


async def test_a_repeated_done_records_its_statistics_again_and_counts_them_once() -> None:
    clock = ManualClock(1000.0)
    backend = MemoryStateBackend(clock, StateOptions())
    pool = PoolManager(PoolPolicy(WorkerRole.DECODE, "t"), backend, MemoryPrefixIndex(), clock)
    await pool.register(Registration("d-done", "m-done", "a:1", num_total_blocks=100), "t")
    await pool.heartbeat(Heartbeat("d-done", WorkerState.READY,
                                   WorkerLoad(num_free_blocks=100, num_total_blocks=100), {}))
    sink = RecordingSink()
    coordinator = KvTransferCoordinator(backend.tickets, backend.workers, clock, stats_sink=sink)
    ticket = await coordinator.open_ticket(TicketSpec("m-done", "d-done", "", 10, 5.0))
    bytes_before = REGISTRY.get_sample_value("pdserve_transfer_moved_bytes_total",
                                             {"deployment": "m-done"}) or 0.0

    # The first report's replica held the blocks and died before its record was safe.
    await backend.tickets.transition(ticket.token, TicketState.DONE)
    await backend.tickets.mark_held(ticket.token)
    record = TransferRecord(ticket, 4096, 0.01, 0.002, 0.0005, TicketState.DONE)
    done = await coordinator.update_progress(ticket.token, TicketState.DONE, record)
    assert done.state is TicketState.DONE and done.is_held
    assert sink.records == [record] and sink.num_waits == 1

    await coordinator.update_progress(ticket.token, TicketState.DONE, record)  # once more
    assert len(sink.records) == 2  # the store keeps one (db.testing.check_transfer_stats)
    bytes_after = REGISTRY.get_sample_value("pdserve_transfer_moved_bytes_total",
                                            {"deployment": "m-done"}) or 0.0
    assert bytes_after - bytes_before == 0  # counted by the first report, which held them


async def test_a_ready_decode_worker_whose_ledger_the_store_lost_is_unavailable_not_invalid(
        ) -> None:
    """A Redis Cluster master that fails over before replicating a worker's ledger loses it
    while the worker's record (on another master) stays: the open is retried (UNAVAILABLE)
    until the worker's next heartbeat writes the ledger again, not refused as bad input."""
    clock = ManualClock(1000.0)
    backend = MemoryStateBackend(clock, StateOptions())
    pool = PoolManager(PoolPolicy(WorkerRole.DECODE, "t"), backend, MemoryPrefixIndex(), clock)
    await pool.register(Registration("d-lost", "m-lost", "a:1", num_total_blocks=100), "t")
    beat = Heartbeat("d-lost", WorkerState.READY,
                     WorkerLoad(num_free_blocks=100, num_total_blocks=100), {})
    await pool.heartbeat(beat)
    await backend.tickets.drop_worker("d-lost")  # the ledger goes, the record stays
    coordinator = KvTransferCoordinator(backend.tickets, backend.workers, clock)
    spec = TicketSpec("m-lost", "d-lost", "", 10, 5.0)
    with pytest.raises(UnavailableError, match="no block ledger"):
        await coordinator.open_ticket(spec)
    await pool.heartbeat(beat)
    assert (await coordinator.open_ticket(spec)).num_blocks == 10
    with pytest.raises(InvalidArgumentError):  # more blocks than it has: still bad input
        await coordinator.open_ticket(TicketSpec("m-lost", "d-lost", "", 1000, 5.0))
