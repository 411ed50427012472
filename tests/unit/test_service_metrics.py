"""Pool managers and the coordinator export what operators plot: pool sizes, free KV blocks,
queued prefill tokens, ticket outcomes, transfer bytes and seconds."""

from __future__ import annotations

from prometheus_client import REGISTRY

from pdserve.common.clock import ManualClock
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


def _value(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_pool_and_transfer_metrics_follow_the_state() -> None:
    clock = ManualClock(1000.0)
    backend = MemoryStateBackend(clock, StateOptions())
    decode = PoolManager(PoolPolicy(WorkerRole.DECODE, "t"), backend, MemoryPrefixIndex(), clock)
    await decode.register(Registration("d-metrics", "m-metrics", "a:1", num_total_blocks=100), "t")
    await decode.heartbeat(Heartbeat("d-metrics", WorkerState.READY,
                                     WorkerLoad(num_free_blocks=70, num_total_blocks=100), {}))
    await decode.check_health()
    assert _value("pdserve_pool_size_workers",
                  {"deployment": "m-metrics", "role": "decode", "state": "ready"}) == 1
    assert _value("pdserve_pool_free_kv_blocks",
                  {"deployment": "m-metrics", "worker": "d-metrics"}) == 70

    coordinator = KvTransferCoordinator(backend.tickets, backend.workers, clock)
    before_done = _value("pdserve_transfer_ended_tickets_total",
                         {"deployment": "m-metrics", "outcome": "done"})
    before_bytes = _value("pdserve_transfer_moved_bytes_total", {"deployment": "m-metrics"})
    ticket = await coordinator.open_ticket(TicketSpec("m-metrics", "d-metrics", "", 10, 5.0))
    record = TransferRecord(ticket, 4096, 0.01, 0.002, 0.0005, TicketState.DONE)
    await coordinator.update_progress(ticket.token, TicketState.DONE, record)
    assert _value("pdserve_transfer_ended_tickets_total",
                  {"deployment": "m-metrics", "outcome": "done"}) == before_done + 1
    assert (
        _value("pdserve_transfer_moved_bytes_total", {"deployment": "m-metrics"})
        == before_bytes + 4096
    )
