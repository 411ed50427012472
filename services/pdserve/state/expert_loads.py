"""Per-expert token counts on their way from the workers to the governor's placement loop.

MoE workers count the tokens routed to every logical expert of every MoE layer and send the counts
since their previous report in heartbeats. The pool manager appends each report to its pool's
queue here; the governor drains the queue (every report is consumed once) into its decayed load
estimate. Soft state, like the prefix index: a lost report only makes the estimate a little older.
Each queue is capped (oldest reports dropped) and expires when nobody appends, so a governor that
is down cannot make the store grow without bound.

Redis layout: one list per pool, ``<prefix>:experts:{<deployment>|<role>}:reports`` (one key, so
every transaction touches one hash slot and the same code runs on Redis Cluster), and one set
``<prefix>:experts:pools`` naming the pools that ever reported.
"""

from __future__ import annotations

import base64
import collections
import json
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import redis.asyncio as aioredis

from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import WorkerRole
from pdserve.state.interfaces import StateBackend
from pdserve.state.redis.calls import store_call

DEFAULT_MAX_REPORTS = 1024
"""Reports kept per pool before the oldest are dropped (about 4 minutes of 40 workers reporting
every 10 s; a DeepSeek-V3 report is 58 x 256 counts, ~120 kB uncompressed)."""
DEFAULT_TTL_S = 3600.0
"""A pool's queue disappears this long after its last report."""


@dataclass(frozen=True, slots=True, eq=False)
class ExpertLoadReport:
    """Tokens one worker routed to each logical expert since its previous report.

    ``token_counts`` is the flattened ``[num_moe_layers, num_experts]`` matrix, every entry >= 0
    (any integer sequence; stored as a read-only ``int64`` array). Raises
    ``InvalidArgumentError`` naming the broken constraint.
    """

    worker_id: str
    num_moe_layers: int
    token_counts: np.ndarray

    def __post_init__(self) -> None:
        try:
            counts = np.array(self.token_counts, dtype=np.int64).reshape(-1)
        except (OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"expert_token_counts: not int64 counts ({exc})",
                                       field="expert_token_counts") from None
        counts.flags.writeable = False
        object.__setattr__(self, "token_counts", counts)
        if self.num_moe_layers < 1:
            raise InvalidArgumentError(
                "num_moe_layers: must be >= 1 when expert_token_counts is set",
                field="num_moe_layers")
        if not counts.size or counts.size % self.num_moe_layers:
            raise InvalidArgumentError(
                f"expert_token_counts: length must be a positive multiple of num_moe_layers "
                f"({self.num_moe_layers}), got {len(self.token_counts)}",
                field="expert_token_counts")
        if counts.min() < 0:
            raise InvalidArgumentError("expert_token_counts: must be >= 0",
                                       field="expert_token_counts")

    @property
    def num_experts(self) -> int:
        return self.token_counts.size // self.num_moe_layers

    def matrix(self) -> np.ndarray:
        """``int64[num_moe_layers, num_experts]`` (read-only)."""
        return self.token_counts.reshape(self.num_moe_layers, -1)


class ExpertLoadStore(Protocol):
    """Queues of expert-load reports, one per (deployment, role) pool."""

    async def append(self, deployment: str, role: WorkerRole, report: ExpertLoadReport) -> None:
        """Queue a report (dropping the pool's oldest beyond the cap)."""
        ...

    async def drain(self, deployment: str, role: WorkerRole) -> list[ExpertLoadReport]:
        """Every queued report of the pool, oldest first, removed from the queue atomically."""
        ...

    async def pools(self) -> list[tuple[str, WorkerRole]]:
        """Pools that have reported (sorted)."""
        ...


def encode_report(report: ExpertLoadReport) -> str:
    """Compact text form: JSON with the counts as base64 of zlib-compressed little-endian uint64."""
    raw = np.asarray(report.token_counts, dtype="<u8").tobytes()
    return json.dumps({
        "worker_id": report.worker_id, "num_moe_layers": report.num_moe_layers,
        "counts": base64.b64encode(zlib.compress(raw, 1)).decode("ascii"),
    })


def decode_report(text: str | bytes) -> ExpertLoadReport:
    fields = json.loads(text)
    raw = zlib.decompress(base64.b64decode(fields["counts"]))
    counts = np.frombuffer(raw, dtype="<u8").astype(np.int64)
    return ExpertLoadReport(fields["worker_id"], int(fields["num_moe_layers"]), counts)


class MemoryExpertLoadStore:
    """In-process queues (the embedded stack)."""

    def __init__(self, max_reports: int = DEFAULT_MAX_REPORTS) -> None:
        self._max_reports = max_reports
        self._queues: dict[tuple[str, WorkerRole], collections.deque[ExpertLoadReport]] = {}

    async def append(self, deployment: str, role: WorkerRole, report: ExpertLoadReport) -> None:
        key = (deployment, WorkerRole(role))
        queue = self._queues.setdefault(key, collections.deque(maxlen=self._max_reports))
        queue.append(report)

    async def drain(self, deployment: str, role: WorkerRole) -> list[ExpertLoadReport]:
        queue = self._queues.get((deployment, WorkerRole(role)))
        if not queue:
            return []
        reports = list(queue)
        queue.clear()
        return reports

    async def pools(self) -> list[tuple[str, WorkerRole]]:
        return sorted(self._queues)


class RedisExpertLoadStore:
    """Queues in Redis (shared by every pool-manager and governor replica)."""

    def __init__(self, client: aioredis.Redis, prefix: str = "pdserve",
                 max_reports: int = DEFAULT_MAX_REPORTS, ttl_s: float = DEFAULT_TTL_S) -> None:
        self._client = client
        self._prefix = prefix
        self._max_reports = max_reports
        self._ttl_ms = int(ttl_s * 1000)

    def _queue_key(self, deployment: str, role: WorkerRole) -> str:
        return f"{self._prefix}:experts:{{{deployment}|{WorkerRole(role).value}}}:reports"

    def _pools_key(self) -> str:
        return f"{self._prefix}:experts:pools"

    @store_call
    async def append(self, deployment: str, role: WorkerRole, report: ExpertLoadReport) -> None:
        key = self._queue_key(deployment, role)
        member = json.dumps([deployment, WorkerRole(role).value])
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.rpush(key, encode_report(report))
            pipe.ltrim(key, -self._max_reports, -1)
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()
        await self._client.sadd(self._pools_key(), member)

    @store_call
    async def drain(self, deployment: str, role: WorkerRole) -> list[ExpertLoadReport]:
        key = self._queue_key(deployment, role)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            items, _ = await pipe.execute()
        return [decode_report(item) for item in items]

    @store_call
    async def pools(self) -> list[tuple[str, WorkerRole]]:
        pools = []
        for member in await self._client.smembers(self._pools_key()):
            deployment, role = json.loads(member)
            pools.append((deployment, WorkerRole(role)))
        return sorted(pools)


_MEMORY_STORES: weakref.WeakKeyDictionary[Any, MemoryExpertLoadStore] = weakref.WeakKeyDictionary()


def expert_load_store_for(backend: StateBackend) -> ExpertLoadStore:
    """The expert-load store that lives beside ``backend``: the same Redis (and key prefix) for
    the Redis backend, one shared in-process store per in-process backend. Services that share a
    backend (the pool managers and the governor of ``pdserve up``) thereby share the queues
    without extra wiring."""
    from pdserve.state.redis.backend import RedisStateBackend

    if isinstance(backend, RedisStateBackend):
        return RedisExpertLoadStore(backend.client, backend.keys.prefix)
    store = _MEMORY_STORES.get(backend)
    if store is None:
        store = MemoryExpertLoadStore()
        _MEMORY_STORES[backend] = store
    return store
