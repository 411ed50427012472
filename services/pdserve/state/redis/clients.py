"""Redis clients for a hot-state URL: one node, a Redis Cluster, or a master behind Sentinel
(the URL forms: ``pdserve.common.redis_url``).

Every client waits for a free connection when all are busy instead of failing at once:
redis-py's default asyncio pool (100 connections since 8.x) fails the 101st concurrent command
at once with ``MaxConnectionsError``; a burst of a few hundred requests makes the coordinator hit
that, and ticket opens, progress reports and releases then fail as UNAVAILABLE (seen in the
multi-process e2e test). A blocking pool queues them instead. (A cluster client keeps one pool
per node, which does fail past ``MAX_CONNECTIONS``: redis-py has no blocking variant.) A cluster
client follows ``MOVED``/``ASK`` redirections itself: they are answered before a command runs.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from pdserve.common.redis_url import CLUSTER_SCHEME, SINGLE_SCHEMES, parse_endpoint

MAX_CONNECTIONS = 128
"""Connections per client (per node on a cluster)."""
POOL_WAIT_S = 10.0
"""How long a command waits for a free connection when all are busy."""
CONNECT_TIMEOUT_S = 5.0


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel's master pool that waits for a free connection (``BlockingConnectionPool``)."""


class _SentinelMaster(Redis):
    """The master's client; ``aclose`` closes its pool and the connections to the sentinels."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool=True)
        if self.sentinel_manager is not None:
            for sentinel_client in self.sentinel_manager.sentinels:
                await sentinel_client.aclose()


def open_client(url: str, **options: Any) -> Any:
    """A ``redis.asyncio`` client (``Redis`` or ``RedisCluster``) for a hot-state URL.
    ``options`` are connection options (``decode_responses``, ``protocol``, ``retry``, ...)."""
    scheme = url.partition("://")[0].lower()
    common: dict[str, Any] = {"socket_connect_timeout": CONNECT_TIMEOUT_S, **options}
    if scheme in SINGLE_SCHEMES:
        pool = BlockingConnectionPool.from_url(
            url, max_connections=MAX_CONNECTIONS, timeout=POOL_WAIT_S, **common)
        client = Redis(connection_pool=pool)
        client.auto_close_connection_pool = True  # aclose() closes the pool it owns
        return client
    endpoint = parse_endpoint(url)
    auth: dict[str, Any] = {"username": endpoint.username, "password": endpoint.password}
    if endpoint.scheme == CLUSTER_SCHEME:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in endpoint.hosts],
            max_connections=MAX_CONNECTIONS, **auth, **common)
    sentinel = Sentinel(list(endpoint.hosts), sentinel_kwargs={
        "socket_connect_timeout": CONNECT_TIMEOUT_S, "retry": Retry(NoBackoff(), 0),
        "decode_responses": True})
    master: _SentinelMaster = sentinel.master_for(
        endpoint.master_name, redis_class=_SentinelMaster,
        connection_pool_class=_BlockingSentinelPool, max_connections=MAX_CONNECTIONS,
        timeout=POOL_WAIT_S, db=endpoint.db, **auth, **common)
    master.sentinel_manager = sentinel
    return master


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)
