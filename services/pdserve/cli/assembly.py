"""Building blocks of service processes: stores, durable writer, and the apps of each service.
Used by ``pdserve serve <service>`` (one service per process) and ``pdserve up`` (all in one)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.common.settings import CommonSettings
from pdserve.db.durable import DurableWriter, open_writer
from pdserve.kv_transfer.rendezvous import MemoryRendezvous, RedisRendezvous, Rendezvous
from pdserve.state.factory import open_backend
from pdserve.state.interfaces import StateBackend
from pdserve.state.prefix_index import MemoryPrefixIndex, PrefixIndex, RedisPrefixIndex

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Stores:
    backend: StateBackend
    prefix_index: PrefixIndex
    rendezvous: Rendezvous
    redis_client: Any = None

    async def close(self) -> None:
        await self.backend.close()
        if self.redis_client is not None:
            await self.redis_client.aclose()


REDIS_MAX_CONNECTIONS = 128
"""Connections per Redis client of a service process."""
REDIS_POOL_WAIT_S = 10.0
"""How long a command waits for a free connection when all are busy."""


def _redis_client(url: str, **kwargs: Any) -> Any:
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


def open_stores(settings: CommonSettings) -> Stores:
    if settings.redis_url.startswith("memory"):
        return Stores(open_backend(settings.redis_url, time.time), MemoryPrefixIndex(),
                      MemoryRendezvous())
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    from pdserve.state.redis.backend import RedisStateBackend

    # The client options of ``RedisStateBackend.from_url`` (RESP2, decoded strings, no automatic
    # retries), with the blocking pool; from_url takes no pool options.
    backend = RedisStateBackend(
        _redis_client(settings.redis_url, decode_responses=True, protocol=2,
                      retry=Retry(NoBackoff(), 0), socket_connect_timeout=5.0),
        time.time)
    client = _redis_client(settings.redis_url)
    return Stores(backend, RedisPrefixIndex(client), RedisRendezvous(client), client)


def open_durable(settings: CommonSettings, *, migrate: bool) -> DurableWriter | None:
    """The durable writer, or None (with a warning) when the database cannot be used."""
    from pdserve.db import upgrade
    from pdserve.db.repository import Repository

    try:
        repository = Repository.from_url(settings.database_url)
        if migrate:
            upgrade(repository.engine)
        return open_writer(repository, settings.database_url, settings.durable_spool_dir,
                           settings.service_name)
    except Exception as exc:  # noqa: BLE001 - serving does not depend on the durable store
        logger.warning("durable store unavailable (%s): decisions and outcomes are not recorded", exc)
        return None
