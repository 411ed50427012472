"""What both in-house runtimes share: the engine, the one thread that runs it, the block
allocator over its cache, and what a worker reports about its passes and handoffs.

Engines (``worker.engine.Engine``) are synchronous and CPU-bound (or sleep, for ``sim``) and not
re-entrant: the runtime runs every step on one thread, so the event loop stays free for gRPC and
the KV transport.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.common.errors import CapacityError
from pdserve.common.types import FencingToken
from pdserve.worker.engine import BlockAllocator, Engine, KvLayout
from pdserve.worker.experts import ExpertParallelEngine, expert_parallel
from pdserve.worker.kv_checksums import MAX_CHECKSUMS, KvChecksum, checksum_of
from pdserve.worker.runtime import ProfilePoint
from pdserve.worker.transports.values import TransferResult

T = TypeVar("T")

MAX_PROFILE_POINTS = 512
"""Recent forward passes a worker keeps for the governor's calibration."""


class EngineScheduler:
    """The engine, its thread and its block allocator; the base of both in-house runtimes.

    ``engine`` may be replaced between calls (tests wrap it); the allocator keeps its layout.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.allocator = BlockAllocator(engine.layout.num_blocks)
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._tasks: list[asyncio.Task[None]] = []
        self._profile: collections.deque[ProfilePoint] = collections.deque(
            maxlen=MAX_PROFILE_POINTS)
        self._kv_checksums: collections.deque[KvChecksum] = collections.deque(
            maxlen=MAX_CHECKSUMS)

    @property
    def layout(self) -> KvLayout:
        return self.engine.layout

    @property
    def profile(self) -> Sequence[ProfilePoint]:
        return self._profile

    @property
    def kv_checksums(self) -> Sequence[KvChecksum]:
        return self._kv_checksums

    @property
    def expert_engine(self) -> ExpertParallelEngine | None:
        return expert_parallel(self.engine)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._engine_thread.shutdown(wait=False, cancel_futures=True)

    def _allocate(self, num_blocks: int) -> list[int]:
        try:
            return self.allocator.allocate(num_blocks)
        except MemoryError as exc:
            raise CapacityError(str(exc), retry_after_s=0.2) from None

    async def _run_engine(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn)

    def _record_checksum(self, token: FencingToken, block_ids: Sequence[int],
                         result: TransferResult | None = None) -> None:
        """Keep the checksum of a handoff's prompt KV as it is in this worker's cache (the
        transfer's own, when ``result`` has one)."""
        self._kv_checksums.append(checksum_of(
            self.engine.kv_cache, token, block_ids,
            frame_version=result.frame_version if result is not None else 0,
            crc32=result.kv_crc32 if result is not None else None))
