"""``PoolEventStream`` on Redis Streams, and the JSON form of a pool event in it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import cast

import redis.asyncio as aioredis

from pdserve.common.types import PoolEvent, PoolEventKind, PoolEvents, PoolSnapshot
from pdserve.state.interfaces import WorkerStore
from pdserve.state.redis.calls import LuaScripts, store_call, unwrap_reply
from pdserve.state.redis.codec import to_ms
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.redis.workers import worker_fields, worker_from_fields
from pdserve.state.shared import (
    MAX_EVENTS_PER_READ,
    StateOptions,
    check_required,
    format_cursor,
    parse_cursor,
)

StreamEntries = Sequence[tuple[str, dict[str, str]]]
"""``XRANGE``/``XREAD`` entries of one stream: ``(entry id, fields)``, oldest first."""


def _event_json(event: PoolEvent) -> str:
    worker = None
    if event.worker is not None:
        worker = worker_fields(event.worker, 0.0)
        del worker["expires_s"]
    return json.dumps(
        {"kind": str(event.kind), "deployment": event.deployment, "worker": worker,
         "worker_id": event.worker_id},
        separators=(",", ":"),
    )


def _event_from_json(payload: str, cursor: str) -> PoolEvent:
    data = json.loads(payload)
    worker = None
    if data["worker"] is not None:
        worker = worker_from_fields({**data["worker"], "expires_s": "0"})
    return PoolEvent(
        cursor=cursor,
        kind=PoolEventKind(data["kind"]),
        deployment=data["deployment"],
        worker=worker,
        worker_id=data["worker_id"],
    )


class RedisPoolEventStream:
    """``PoolEventStream`` on Redis Streams, one stream per deployment with approximate MAXLEN
    trimming. Cursors are ``epoch:seq``; the epoch is new whenever the stream's meta hash is
    missing (a store loss), so an old cursor is then a gap, as is one older than the oldest
    retained event."""

    def __init__(self, client: aioredis.Redis, scripts: LuaScripts, keys: RedisKeys,
                 options: StateOptions) -> None:
        self._client = client
        self._scripts = scripts
        self._keys = keys
        self._options = options

    def _stream_keys(self, deployment: str) -> list[str]:
        return [self._keys.events_meta(deployment), self._keys.events_stream(deployment)]

    @store_call
    async def publish(self, event: PoolEvent) -> str:
        check_required(event.deployment, "deployment")
        epoch, seq = unwrap_reply(
            await self._scripts(
                "events_publish", self._stream_keys(event.deployment),
                [uuid.uuid4().hex, self._options.stream_max_len, _event_json(event)],
            )
        )
        return format_cursor(epoch, int(seq))

    async def _head(self, deployment: str) -> tuple[str, int]:
        epoch, seq = unwrap_reply(
            await self._scripts("events_head", self._stream_keys(deployment), [uuid.uuid4().hex])
        )
        return epoch, int(seq)

    @store_call
    async def read(self, deployment: str, cursor: str, timeout_s: float = 0.0) -> PoolEvents:
        parsed = parse_cursor(cursor)
        epoch, last_seq = await self._head(deployment)
        head = format_cursor(epoch, last_seq)
        if parsed is None or parsed[0] != epoch or parsed[1] > last_seq:
            return PoolEvents((), head, is_gap=True)
        seq = parsed[1]
        stream_key = self._keys.events_stream(deployment)
        if seq < last_seq:
            entries = cast(StreamEntries, await self._client.xrange(
                stream_key, f"{seq + 1}-0", "+", count=MAX_EVENTS_PER_READ
            ))
            return self._events_or_gap(epoch, seq, entries, head)
        if timeout_s <= 0:
            return PoolEvents((), cursor, is_gap=False)
        # RESP2: ``[[stream key, entries]]`` (one stream asked), or empty after the timeout.
        reply = cast(list[tuple[str, StreamEntries]], await self._client.xread(
            {stream_key: f"{seq}-0"}, count=MAX_EVENTS_PER_READ, block=to_ms(timeout_s)
        ))
        if not reply:
            return PoolEvents((), cursor, is_gap=False)
        new_epoch, new_seq = await self._head(deployment)
        if new_epoch != epoch:  # the store was lost while we waited
            return PoolEvents((), format_cursor(new_epoch, new_seq), is_gap=True)
        return self._events_or_gap(epoch, seq, reply[0][1], head)

    @staticmethod
    def _events_or_gap(
        epoch: str, seq: int, entries: StreamEntries, head: str
    ) -> PoolEvents:
        """Events after ``seq``, or a gap when the first of them is not ``seq + 1`` (trimmed)."""
        seqs = [int(entry_id.partition("-")[0]) for entry_id, _ in entries]
        if not seqs or seqs[0] != seq + 1:
            return PoolEvents((), head, is_gap=True)
        events = tuple(
            _event_from_json(fields["event"], format_cursor(epoch, s))
            for s, (_, fields) in zip(seqs, entries, strict=True)
        )
        return PoolEvents(events, events[-1].cursor, is_gap=False)

    @store_call
    async def snapshot(self, deployment: str, workers: WorkerStore) -> PoolSnapshot:
        # The cursor first: events after it may repeat what the list shows, but none is lost.
        epoch, seq = await self._head(deployment)
        return PoolSnapshot(tuple(await workers.list(deployment)), format_cursor(epoch, seq))
