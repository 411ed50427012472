"""A store outage is no worker's silence: heartbeats the store could not take do not make the
pool manager fail every worker the moment the store answers again (a Sentinel failover takes
longer than the heartbeat timeout); a worker that stays silent after it is still failed."""

from __future__ import annotations

import pytest

from pdserve.common.clock import ManualClock
from pdserve.common.errors import UnavailableError
from pdserve.common.types import WorkerLoad, WorkerRole, WorkerState
from pdserve.pool.manager import Heartbeat, PoolManager, PoolPolicy, Registration
from pdserve.state.factory import StateOptions
from pdserve.state.memory.backend import MemoryStateBackend
from pdserve.state.prefix_index import MemoryPrefixIndex

LOAD = WorkerLoad(num_free_blocks=10, num_total_blocks=10)


class FlakyWorkers:
    """The backend's worker store, whose heartbeat writes fail while ``is_down``."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.is_down = False

    async def heartbeat(self, *args: object, **kwargs: object) -> object:
        if self.is_down:
            raise UnavailableError("state store unavailable (a failover)")
        return await self._inner.heartbeat(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


async def test_heartbeats_lost_to_a_store_outage_fail_no_worker() -> None:
    clock = ManualClock(1000.0)
    backend = MemoryStateBackend(clock, StateOptions())
    workers = FlakyWorkers(backend.workers)
    backend.workers = workers  # type: ignore[assignment]
    pool = PoolManager(PoolPolicy(WorkerRole.DECODE, "t"), backend, MemoryPrefixIndex(), clock)
    timeout_s = pool.policy.heartbeat_timeout_s
    await pool.register(Registration("d-1", "m", "a:1", num_total_blocks=10), "t")
    beat = Heartbeat("d-1", WorkerState.READY, LOAD, {})
    await pool.heartbeat(beat)
    workers.is_down = True
    for _ in range(4):  # the outage outlasts the timeout; the worker keeps beating
        clock.advance(timeout_s / 2)
        with pytest.raises(UnavailableError):
            await pool.heartbeat(beat)
    workers.is_down = False
    clock.advance(0.5)
    assert await pool.check_health() == []  # the store is back before the worker's next beat
    await pool.heartbeat(beat)
    clock.advance(timeout_s + 0.1)  # now it is silent
    assert [r.worker_id for r in await pool.check_health()] == ["d-1"]
