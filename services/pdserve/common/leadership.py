"""Leases for work that must run on one replica at a time: pool actuation (starting and
stopping workers), the governor's autoscaling loop (active/standby).

A lease is a key in Redis naming its holder, with a TTL: ``acquire`` takes it when nobody holds
it, ``renew`` extends it only while this holder still has it, ``release`` gives it up. Every
acquisition gets a **fencing token**, a number larger than every earlier token of that lease
(the larger of a counter and Redis's clock in milliseconds, so it keeps growing across a Redis
restart that lost the counter); work done under a lease can carry the token so a receiver can
refuse a deposed holder's late actions.

``LeaderElector`` runs the loop: a standby tries every ``ttl_s / 3``, the holder renews at the
same cadence and steps down (``is_leader`` false, ``on_lost`` called) as soon as a renewal fails
or cannot be confirmed within the lease, so two holders never act at once for longer than the
clock drift between them. A dead holder's lease lapses after ``ttl_s``; a standby takes over
within about ``ttl_s + ttl_s / 3``.

Keys ``pdserve:lease:{<name>}`` and ``pdserve:lease:{<name>}:epoch`` share a hash tag, so the
scripts run on Redis Cluster. ``MemoryLease`` is the in-process stand-in (one process: always
granted to the first holder).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

logger = logging.getLogger(__name__)

_ACQUIRE = """
local key, epoch_key = KEYS[1], KEYS[2]
local holder, ttl_ms = ARGV[1], tonumber(ARGV[2])
local current = redis.call('GET', key)
if current then
  local sep = string.find(current, '|', 1, true)
  if string.sub(current, sep + 1) == holder then
    redis.call('PEXPIRE', key, ttl_ms)
    return tonumber(string.sub(current, 1, sep - 1))
  end
  return false
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local token = redis.call('INCR', epoch_key)
if token < now_ms then
  token = now_ms
  redis.call('SET', epoch_key, token)
end
redis.call('SET', key, token .. '|' .. holder, 'PX', ttl_ms)
return token
"""

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease(Protocol):
    name: str
    holder: str

    async def acquire(self, ttl_s: float) -> int | None:
        """The fencing token if this holder has the lease now (taken or already held)."""
        ...

    async def renew(self, token: int, ttl_s: float) -> bool:
        """Extend the lease taken with ``token``; False if it was lost."""
        ...

    async def release(self, token: int) -> None: ...

    async def current_holder(self) -> str | None: ...


class RedisLease:
    def __init__(self, client: Any, name: str, holder: str, prefix: str = "pdserve") -> None:
        """``client``: a ``redis.asyncio.Redis`` (bytes or decoded replies)."""
        self._client = client
        self.name = name
        self.holder = holder
        self._key = f"{prefix}:lease:{{{name}}}"
        self._epoch_key = f"{self._key}:epoch"

    async def acquire(self, ttl_s: float) -> int | None:
        token = await self._client.eval(_ACQUIRE, 2, self._key, self._epoch_key, self.holder,
                                        _ms(ttl_s))
        return int(token) if token else None

    async def renew(self, token: int, ttl_s: float) -> bool:
        return bool(await self._client.eval(_RENEW, 1, self._key, f"{token}|{self.holder}",
                                            _ms(ttl_s)))

    async def release(self, token: int) -> None:
        await self._client.eval(_RELEASE, 1, self._key, f"{token}|{self.holder}")

    async def current_holder(self) -> str | None:
        value = await self._client.get(self._key)
        if value is None:
            return None
        text = value.decode() if isinstance(value, bytes) else str(value)
        return text.partition("|")[2]


class MemoryLease:
    """In-process lease (``memory://`` stores): shared by the ``MemoryLease`` objects that are
    given the same ``table`` dict."""

    def __init__(self, name: str, holder: str,
                 table: dict[str, tuple[str, int, float]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.holder = holder
        self._table = table if table is not None else {}
        self._clock = clock
        self._epoch = 0

    async def acquire(self, ttl_s: float) -> int | None:
        now = self._clock()
        current = self._table.get(self.name)
        if current is not None and current[2] > now and current[0] != self.holder:
            return None
        if current is not None and current[0] == self.holder and current[2] > now:
            token = current[1]
        else:
            self._epoch = max(self._epoch, current[1] if current else 0) + 1
            token = self._epoch
        self._table[self.name] = (self.holder, token, now + ttl_s)
        return token

    async def renew(self, token: int, ttl_s: float) -> bool:
        current = self._table.get(self.name)
        if current is None or current[:2] != (self.holder, token) or current[2] <= self._clock():
            return False
        self._table[self.name] = (self.holder, token, self._clock() + ttl_s)
        return True

    async def release(self, token: int) -> None:
        current = self._table.get(self.name)
        if current is not None and current[:2] == (self.holder, token):
            del self._table[self.name]

    async def current_holder(self) -> str | None:
        current = self._table.get(self.name)
        return current[0] if current is not None and current[2] > self._clock() else None


class LeaderElector:
    """Holds ``lease`` whenever it can; ``is_leader`` says whether this replica may act now.

    ``on_elected(token)`` / ``on_lost()`` are awaited when leadership changes. Store errors
    count as a failed renewal: a leader that cannot confirm its lease steps down.
    """

    def __init__(self, lease: Lease, ttl_s: float = 5.0,
                 on_elected: Callable[[int], Awaitable[None]] | None = None,
                 on_lost: Callable[[], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.lease = lease
        self.ttl_s = ttl_s
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._clock = clock
        self.token: int | None = None
        self._valid_until = 0.0
        self.num_elections = 0

    @property
    def is_leader(self) -> bool:
        """True while this replica holds the lease, as last confirmed (and not yet lapsed)."""
        return self.token is not None and self._clock() < self._valid_until

    async def step(self) -> bool:
        """One acquire-or-renew; returns ``is_leader``."""
        started = self._clock()
        try:
            if self.token is None:
                token = await self.lease.acquire(self.ttl_s)
                if token is not None:
                    self.token = token
                    self._valid_until = started + self.ttl_s
                    self.num_elections += 1
                    logger.info("lease %s: %s is the leader (token %d)", self.lease.name,
                                self.lease.holder, token)
                    if self._on_elected is not None:
                        await self._on_elected(token)
            elif await self.lease.renew(self.token, self.ttl_s):
                self._valid_until = started + self.ttl_s
            else:
                await self._lose("lease lost")
        except Exception as exc:  # noqa: BLE001 - store down: not confirmed, maybe lapsed
            if self.token is not None and self._clock() >= self._valid_until:
                await self._lose(f"lease not confirmed ({exc})")
            else:
                logger.debug("lease %s: step failed: %s", self.lease.name, exc)
        return self.is_leader

    async def _lose(self, why: str) -> None:
        logger.warning("lease %s: %s steps down: %s", self.lease.name, self.lease.holder, why)
        self.token = None
        self._valid_until = 0.0
        if self._on_lost is not None:
            await self._on_lost()

    async def run(self, stop: asyncio.Event) -> None:
        """Acquire or renew every ``ttl_s / 3`` until ``stop``; then release."""
        while not stop.is_set():
            await self.step()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.ttl_s / 3)
        if self.token is not None:
            with contextlib.suppress(Exception):
                await self.lease.release(self.token)
            self.token = None


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def holder_id() -> str:
    """A name for this process as a lease holder: host, process id and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def open_lease(redis_client: Any, name: str, holder: str) -> Lease:
    """A Redis lease on ``redis_client``, or an in-process one when it is None (memory stores)."""
    if redis_client is None:
        return MemoryLease(name, holder)
    return RedisLease(redis_client, name, holder)
