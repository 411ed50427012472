"""Which prefix blocks each worker holds, from the hashes workers report in heartbeats.

A prompt's prefix hashes are chained (``pdserve.common.tokenizer.prefix_block_hashes``), so a
worker's overlap with a prompt is the number of *leading* hashes it holds. Soft state: after a
store restart the pool asks workers for a full report.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import redis.asyncio as aioredis

from pdserve.state.redis.calls import store_call


class PrefixIndex(Protocol):
    async def update(
        self, deployment: str, worker_id: str, added: Iterable[int], removed: Iterable[int],
        is_full: bool = False,
    ) -> None: ...

    async def overlap(
        self, deployment: str, worker_ids: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds."""
        ...

    async def drop(self, deployment: str, worker_id: str) -> None: ...


def _leading(held: Sequence[bool]) -> int:
    count = 0
    for is_held in held:
        if not is_held:
            break
        count += 1
    return count


class MemoryPrefixIndex:
    def __init__(self) -> None:
        self._sets: dict[tuple[str, str], set[int]] = {}

    async def update(
        self, deployment: str, worker_id: str, added: Iterable[int], removed: Iterable[int],
        is_full: bool = False,
    ) -> None:
        key = (deployment, worker_id)
        held = set() if is_full else self._sets.setdefault(key, set())
        held.update(added)
        held.difference_update(removed)
        self._sets[key] = held

    async def overlap(
        self, deployment: str, worker_ids: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        result = {}
        for worker_id in worker_ids:
            held = self._sets.get((deployment, worker_id), set())
            result[worker_id] = _leading([h in held for h in hashes])
        return result

    async def drop(self, deployment: str, worker_id: str) -> None:
        self._sets.pop((deployment, worker_id), None)


class RedisPrefixIndex:
    """One set per worker; an overlap query is one pipelined SMISMEMBER per candidate."""

    def __init__(
        self, client: aioredis.Redis, prefix: str = "pdserve", ttl_s: float = 600.0
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._ttl_ms = int(ttl_s * 1000)

    def _key(self, deployment: str, worker_id: str) -> str:
        return f"{self._prefix}:prefix:{deployment}:{worker_id}"

    @store_call
    async def update(
        self, deployment: str, worker_id: str, added: Iterable[int], removed: Iterable[int],
        is_full: bool = False,
    ) -> None:
        key = self._key(deployment, worker_id)
        added_members = [str(h) for h in added]
        removed_members = [str(h) for h in removed]
        async with self._client.pipeline(transaction=True) as pipe:
            if is_full:
                pipe.delete(key)
            if added_members:
                pipe.sadd(key, *added_members)
            if removed_members:
                pipe.srem(key, *removed_members)
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()

    @store_call
    async def overlap(
        self, deployment: str, worker_ids: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        if not hashes or not worker_ids:
            return {worker_id: 0 for worker_id in worker_ids}
        members = [str(h) for h in hashes]
        async with self._client.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.smismember(self._key(deployment, worker_id), members)
            replies = await pipe.execute()
        return {
            worker_id: _leading([bool(x) for x in reply])
            for worker_id, reply in zip(worker_ids, replies, strict=True)
        }

    @store_call
    async def drop(self, deployment: str, worker_id: str) -> None:
        await self._client.delete(self._key(deployment, worker_id))
