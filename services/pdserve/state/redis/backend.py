"""The Redis ``StateBackend``: the six Redis stores over one client, key prefix and script set."""

from __future__ import annotations

import dataclasses

import redis.asyncio as aioredis
from redis import exceptions as redis_errors
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pdserve.common.errors import ConfigError
from pdserve.common.redis_url import SENTINEL_SCHEME, parse_endpoint
from pdserve.common.types import Clock
from pdserve.state.redis.calls import LuaScripts
from pdserve.state.redis.clients import is_cluster, open_client
from pdserve.state.redis.events import RedisPoolEventStream
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.redis.targets import RedisTargetStore
from pdserve.state.redis.thresholds import RedisThresholdStore
from pdserve.state.redis.tickets import RedisTicketLedger
from pdserve.state.redis.tokenizers import RedisTokenizerStore
from pdserve.state.redis.workers import RedisWorkerStore
from pdserve.state.shared import StateOptions


class RedisStateBackend:
    """``StateBackend`` on one Redis (or, with the same scripts, a Redis Cluster client).
    ``clock`` is the coordinator's clock. ``client`` must decode replies to text
    (``decode_responses=True``) and use RESP2, as the one ``from_url`` makes does."""

    def __init__(
        self, client: aioredis.Redis, clock: Clock, options: StateOptions | None = None
    ) -> None:
        options = options or StateOptions()
        self.client = client
        self.keys = RedisKeys(options.key_prefix)
        if options.replica_acks and is_cluster(client):
            raise ConfigError("replica_acks: not supported on a Redis Cluster (its WAIT would "
                              "not follow a script to its slot's master)")
        scripts = LuaScripts(client, options.replica_acks, options.replica_ack_timeout_s)
        self.workers = RedisWorkerStore(client, scripts, self.keys, clock)
        self.tickets = RedisTicketLedger(client, scripts, self.keys, clock, options)
        self.events = RedisPoolEventStream(client, scripts, self.keys, options)
        self.targets = RedisTargetStore(client, self.keys)
        self.tokenizers = RedisTokenizerStore(client, scripts, self.keys, clock)
        self.thresholds = RedisThresholdStore(client, scripts, self.keys, clock)

    @classmethod
    def from_url(
        cls, url: str, clock: Clock, options: StateOptions | None = None
    ) -> RedisStateBackend:
        """A client for ``url`` (one node, a cluster or a Sentinel master, see
        ``pdserve.common.redis_url``) with RESP2 replies, string decoding and no automatic
        retries (a retried script may already have run). A Sentinel URL's ``replica_acks``
        overrides the one in ``options``."""
        options = options or StateOptions()
        if url.lower().startswith(f"{SENTINEL_SCHEME}://"):
            acks = parse_endpoint(url).replica_acks
            options = dataclasses.replace(options, replica_acks=acks) if acks else options
        client = open_client(url, decode_responses=True, protocol=2, retry=Retry(NoBackoff(), 0))
        return cls(client, clock, options)

    async def ping(self) -> bool:
        try:
            return bool(await self.client.ping())
        except (redis_errors.ConnectionError, redis_errors.TimeoutError):
            return False

    async def close(self) -> None:
        await self.tickets.finish_background_writes()
        await self.client.aclose()
