"""``WorkerStore`` in process memory."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from pdserve.common.errors import NotFoundError
from pdserve.common.types import Clock, WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.state.shared import check_required, check_ttl


class MemoryWorkerStore:
    """``WorkerStore`` in process memory; a record expires ``ttl_s`` after its last upsert or
    heartbeat, on the injected clock."""

    def __init__(self, clock: Clock, lock: asyncio.Lock) -> None:
        self._clock = clock
        self._lock = lock
        self._records: dict[str, tuple[WorkerRecord, float]] = {}

    async def upsert(self, worker: WorkerRecord, ttl_s: float) -> None:
        check_required(worker.worker_id, "worker_id")
        check_ttl(ttl_s)
        async with self._lock:
            self._records[worker.worker_id] = (worker, self._clock() + ttl_s)

    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> WorkerRecord:
        check_ttl(ttl_s)
        async with self._lock:
            now = self._clock()
            record = self._require(worker_id, now)
            record = replace(record, load=load, last_heartbeat_s=now)
            self._records[worker_id] = (record, now + ttl_s)
            return record

    async def set_state(self, worker_id: str, state: WorkerState) -> WorkerRecord:
        state = WorkerState(state)
        async with self._lock:
            now = self._clock()
            record = replace(self._require(worker_id, now), state=state)
            self._records[worker_id] = (record, self._records[worker_id][1])
            return record

    async def get(self, worker_id: str) -> WorkerRecord | None:
        async with self._lock:
            return self._live(worker_id, self._clock())

    async def list(
        self, deployment: str | None = None, role: WorkerRole | None = None
    ) -> list[WorkerRecord]:
        async with self._lock:
            now = self._clock()
            records = [self._live(worker_id, now) for worker_id in sorted(self._records)]
            return [
                r
                for r in records
                if r is not None
                and (deployment is None or r.deployment == deployment)
                and (role is None or r.role == role)
            ]

    async def remove(self, worker_id: str) -> None:
        async with self._lock:
            self._records.pop(worker_id, None)

    def _live(self, worker_id: str, now: float) -> WorkerRecord | None:
        item = self._records.get(worker_id)
        if item is None:
            return None
        if item[1] <= now:
            del self._records[worker_id]
            return None
        return item[0]

    def _require(self, worker_id: str, now: float) -> WorkerRecord:
        record = self._live(worker_id, now)
        if record is None:
            raise NotFoundError(f"no worker {worker_id!r} (expired or never registered)")
        return record
