"""Building blocks of service processes: stores, durable writer, and the apps of each service.
Used by ``pdserve serve <service>`` (one service per process) and ``pdserve up`` (all in one)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.common.durable import DurableWriter
from pdserve.common.settings import CommonSettings
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


def open_stores(settings: CommonSettings) -> Stores:
    backend = open_backend(settings.redis_url, time.time)
    if settings.redis_url.startswith("memory"):
        return Stores(backend, MemoryPrefixIndex(), MemoryRendezvous())
    import redis.asyncio as aioredis

    client = aioredis.from_url(settings.redis_url)
    return Stores(backend, RedisPrefixIndex(client), RedisRendezvous(client), client)


def open_durable(settings: CommonSettings, *, migrate: bool) -> DurableWriter | None:
    """The durable writer, or None (with a warning) when the database cannot be used."""
    from pdserve.db import upgrade
    from pdserve.db.repository import Repository

    try:
        repository = Repository.from_url(settings.database_url)
        if migrate:
            upgrade(repository.engine)
        return DurableWriter(repository)
    except Exception as exc:  # noqa: BLE001 - serving does not depend on the durable store
        logger.warning("durable store unavailable (%s): decisions and outcomes are not recorded", exc)
        return None
