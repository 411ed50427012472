"""The in-process ``StateBackend``: the six memory stores, one lock shared by the stores whose
calls must be atomic with respect to each other."""

from __future__ import annotations

import asyncio

from pdserve.common.types import Clock
from pdserve.state.memory.events import MemoryPoolEventStream
from pdserve.state.memory.targets import MemoryTargetStore
from pdserve.state.memory.thresholds import MemoryThresholdStore
from pdserve.state.memory.tickets import MemoryTicketLedger
from pdserve.state.memory.tokenizers import MemoryTokenizerStore
from pdserve.state.memory.workers import MemoryWorkerStore
from pdserve.state.shared import StateOptions


class MemoryStateBackend:
    """``StateBackend`` for one process. ``clock`` is the coordinator's clock."""

    def __init__(self, clock: Clock, options: StateOptions | None = None) -> None:
        options = options or StateOptions()
        lock = asyncio.Lock()
        self.workers = MemoryWorkerStore(clock, lock)
        self.tickets = MemoryTicketLedger(clock, options, lock)
        self.events = MemoryPoolEventStream(options)
        self.targets = MemoryTargetStore()
        self.tokenizers = MemoryTokenizerStore(clock)
        self.thresholds = MemoryThresholdStore(clock)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None
