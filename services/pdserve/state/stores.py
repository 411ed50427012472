"""The hot-state stores of one service process, opened from its Redis URL.

``memory://`` gives the in-process backend (one process: ``pdserve up``, tests); a Redis URL
gives the shared Redis backend (one node, a Redis Cluster or a Sentinel master: the URL forms are
in ``pdserve.common.redis_url``), its prefix index, and a raw client for the services that
keep their own keys beside them (leases, the coordinator's rendezvous).

The prefix index has a client of its own that never retries inside redis-py: routing asks it
for every request and routes without prefix hints when it fails, so failing at once beats
redis-py's retries (on a Redis Cluster they reconnect the whole client and sleep, three times:
while a crashed master's replica was promoted, each request's routing waited out the failover).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdserve.common.types import Clock
from pdserve.state.factory import open_backend
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex


@dataclass(slots=True)
class Stores:
    """``redis_client`` is None for the in-process backend."""

    backend: StateBackend
    prefix_index: PrefixIndex
    redis_client: Any = None
    prefix_client: Any = None
    """The prefix index's own client (no retries inside redis-py)."""

    async def close(self) -> None:
        await self.backend.close()
        for client in (self.redis_client, self.prefix_client):
            if client is not None:
                await client.aclose()


def open_stores(url: str, clock: Clock = time.time) -> Stores:
    """The stores at ``url`` (``memory://`` or a Redis URL); ``clock`` is the coordinator's."""
    if url.startswith("memory"):
        return Stores(open_backend(url, clock), MemoryPrefixIndex())
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from pdserve.state.redis.backend import RedisStateBackend
    from pdserve.state.redis.clients import open_client

    backend = RedisStateBackend.from_url(url, clock)
    client = open_client(url)
    prefix_client = open_client(url, retry=Retry(NoBackoff(), 0))
    return Stores(backend, RedisPrefixIndex(prefix_client), client, prefix_client)
