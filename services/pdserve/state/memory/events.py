"""``PoolEventStream`` in process memory."""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from dataclasses import dataclass, field, replace

from pdserve.common.types import PoolEvent, PoolEvents, PoolSnapshot
from pdserve.state.interfaces import WorkerStore
from pdserve.state.shared import (
    MAX_EVENTS_PER_READ,
    StateOptions,
    check_required,
    format_cursor,
    parse_cursor,
)


@dataclass(slots=True)
class _Stream:
    max_len: int
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_seq: int = 0
    entries: deque[tuple[int, PoolEvent]] = field(init=False)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def __post_init__(self) -> None:
        self.entries = deque(maxlen=self.max_len)

    def collect(self, cursor: str) -> PoolEvents:
        """Events after ``cursor``, or a gap if some of them are gone (or the cursor is from
        another epoch, i.e. another store)."""
        head = format_cursor(self.epoch, self.last_seq)
        parsed = parse_cursor(cursor)
        if parsed is None or parsed[0] != self.epoch or parsed[1] > self.last_seq:
            return PoolEvents((), head, is_gap=True)
        seq = parsed[1]
        if seq == self.last_seq:
            return PoolEvents((), cursor, is_gap=False)
        first_seq = self.entries[0][0] if self.entries else self.last_seq + 1
        if first_seq > seq + 1:
            return PoolEvents((), head, is_gap=True)
        events = tuple(e for s, e in self.entries if s > seq)[:MAX_EVENTS_PER_READ]
        return PoolEvents(events, events[-1].cursor, is_gap=False)


class MemoryPoolEventStream:
    """``PoolEventStream`` in process memory: the last ``stream_max_len`` events per deployment.
    The epoch is new per process, so a cursor from another process is always a gap."""

    def __init__(self, options: StateOptions) -> None:
        self._options = options
        self._streams: dict[str, _Stream] = {}

    def _stream(self, deployment: str) -> _Stream:
        stream = self._streams.get(deployment)
        if stream is None:
            stream = self._streams[deployment] = _Stream(self._options.stream_max_len)
        return stream

    async def publish(self, event: PoolEvent) -> str:
        check_required(event.deployment, "deployment")
        stream = self._stream(event.deployment)
        stream.last_seq += 1
        cursor = format_cursor(stream.epoch, stream.last_seq)
        stream.entries.append((stream.last_seq, replace(event, cursor=cursor)))
        async with stream.changed:
            stream.changed.notify_all()
        return cursor

    async def read(self, deployment: str, cursor: str, timeout_s: float = 0.0) -> PoolEvents:
        stream = self._stream(deployment)
        result = stream.collect(cursor)
        if result.events or result.is_gap or timeout_s <= 0:
            return result
        seq = stream.last_seq
        async with stream.changed:
            try:
                await asyncio.wait_for(
                    stream.changed.wait_for(lambda: stream.last_seq > seq), timeout_s
                )
            except TimeoutError:
                return result
        return stream.collect(cursor)

    async def snapshot(self, deployment: str, workers: WorkerStore) -> PoolSnapshot:
        stream = self._stream(deployment)
        cursor = format_cursor(stream.epoch, stream.last_seq)
        return PoolSnapshot(tuple(await workers.list(deployment)), cursor)
