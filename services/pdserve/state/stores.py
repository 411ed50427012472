"""The hot-state stores of one service process, opened from its Redis URL.

``memory://`` gives the in-process backend (one process: ``pdserve up``, tests); a Redis URL
gives the shared Redis backend, its prefix index, and a raw client for the services that keep
their own keys beside them (leases, the coordinator's rendezvous).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdserve.common.types import Clock
from pdserve.state.factory import open_backend
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex

REDIS_MAX_CONNECTIONS = 128
"""Connections per Redis client of a service process."""
REDIS_POOL_WAIT_S = 10.0
"""How long a command waits for a free connection when all are busy."""


@dataclass(slots=True)
class Stores:
    """``redis_client`` is None for the in-process backend."""

    backend: StateBackend
    prefix_index: PrefixIndex
    redis_client: Any = None

    async def close(self) -> None:
        await self.backend.close()
        if self.redis_client is not None:
            await self.redis_client.aclose()


def redis_client(url: str, **kwargs: Any) -> Any:
    """A Redis client whose commands wait for a free connection when all are busy.

    redis-py's default asyncio pool (100 connections since 8.x) fails the 101st concurrent
    command at once with ``MaxConnectionsError``; a burst of a few hundred requests makes the
    coordinator hit that, and ticket opens, progress reports and releases then fail as
    UNAVAILABLE (seen in the multi-process e2e test). A blocking pool queues them instead.
    """
    import redis.asyncio as aioredis

    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=REDIS_MAX_CONNECTIONS, timeout=REDIS_POOL_WAIT_S, **kwargs)
    client = aioredis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # aclose() closes the pool it owns
    return client


def open_stores(url: str, clock: Clock = time.time) -> Stores:
    """The stores at ``url`` (``memory://`` or a Redis URL); ``clock`` is the coordinator's."""
    if url.startswith("memory"):
        return Stores(open_backend(url, clock), MemoryPrefixIndex())
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from pdserve.state.redis.backend import RedisStateBackend

    # The client options of ``RedisStateBackend.from_url`` (RESP2, decoded strings, no automatic
    # retries), with the blocking pool; from_url takes no pool options.
    backend = RedisStateBackend(
        redis_client(url, decode_responses=True, protocol=2, retry=Retry(NoBackoff(), 0),
                     socket_connect_timeout=5.0),
        clock)
    client = redis_client(url)
    return Stores(backend, RedisPrefixIndex(client), client)
