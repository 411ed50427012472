"""``TargetStore`` on Redis: one string per (deployment, role)."""

from __future__ import annotations

import redis.asyncio as aioredis

from pdserve.common.types import WorkerRole
from pdserve.state.redis.calls import store_call
from pdserve.state.redis.codec import text_or_none
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.shared import check_count, check_required


class RedisTargetStore:
    """Target pool sizes, read by every pool-manager replica."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._client = client
        self._keys = keys

    @store_call
    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None:
        check_required(deployment, "deployment")
        check_count(num_workers, "num_workers", 0)
        await self._client.set(self._keys.target(deployment, WorkerRole(role)), num_workers)

    @store_call
    async def get_target(self, deployment: str, role: WorkerRole) -> int | None:
        key = self._keys.target(deployment, WorkerRole(role))
        value = text_or_none(await self._client.get(key))
        return None if value is None else int(value)
