"""Rendezvous of a ticket's two workers: the decode worker publishes where the KV goes, the
prefill worker waits for it. The router's fast path hands the destination to the prefill worker
directly (it learns it from AdmitTicket); this is the path for callers that dispatch both sides
at once without waiting. Entries live as long as a lease at most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Protocol

import redis.asyncio as aioredis

from pdserve.common.types import FencingToken
from pdserve.state.redis.calls import store_call


class Rendezvous(Protocol):
    """Declared as methods returning awaitables (not ``async def``) so that implementations may
    wrap coroutines (``store_call`` maps Redis failures to ``UnavailableError``)."""

    def publish(self, token: FencingToken, payload: bytes, ttl_s: float) -> Awaitable[None]: ...

    def wait(self, token: FencingToken, timeout_s: float) -> Awaitable[bytes | None]:
        """The payload, or None if nothing was published within ``timeout_s``."""
        ...

    def forget(self, token: FencingToken) -> Awaitable[None]: ...


class MemoryRendezvous:
    """One process; entries expire lazily when forgotten or after ``ttl_s`` (loop time)."""

    def __init__(self) -> None:
        self._payloads: dict[str, bytes] = {}
        self._events: dict[str, asyncio.Event] = {}

    async def publish(self, token: FencingToken, payload: bytes, ttl_s: float) -> None:
        key = str(token)
        self._payloads[key] = payload
        self._events.setdefault(key, asyncio.Event()).set()
        asyncio.get_running_loop().call_later(ttl_s, self._drop, key)

    async def wait(self, token: FencingToken, timeout_s: float) -> bytes | None:
        key = str(token)
        if key in self._payloads:
            return self._payloads[key]
        event = self._events.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return None
        return self._payloads.get(key)

    async def forget(self, token: FencingToken) -> None:
        self._drop(str(token))

    def _drop(self, key: str) -> None:
        self._payloads.pop(key, None)
        self._events.pop(key, None)


def _as_bytes(value: bytes | str | None) -> bytes | None:
    """A payload as stored: bytes (a client that decodes responses would hand back str)."""
    return value.encode() if isinstance(value, str) else value


class RedisRendezvous:
    """Shared by coordinator replicas: a key per ticket attempt plus a pub/sub wake-up."""

    def __init__(self, client: aioredis.Redis, prefix: str = "pdserve") -> None:
        self._client = client
        self._prefix = prefix

    def _key(self, token: FencingToken) -> str:
        return f"{self._prefix}:rendezvous:{token.ticket_id}:{token.attempt}"

    @store_call
    async def publish(self, token: FencingToken, payload: bytes, ttl_s: float) -> None:
        key = self._key(token)
        await self._client.set(key, payload, px=max(1, int(ttl_s * 1000)))
        await self._client.publish(key, b"1")

    @store_call
    async def wait(self, token: FencingToken, timeout_s: float) -> bytes | None:
        key = self._key(token)
        payload = _as_bytes(await self._client.get(key))
        if payload is not None:
            return payload
        pubsub = self._client.pubsub()
        try:
            await pubsub.subscribe(key)
            payload = _as_bytes(await self._client.get(key))  # published between GET and SUBSCRIBE
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while payload is None:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                message = await pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=min(remaining, 1.0)
                )
                if message is not None:
                    payload = _as_bytes(await self._client.get(key))
            return payload
        finally:
            await pubsub.aclose()

    @store_call
    async def forget(self, token: FencingToken) -> None:
        await self._client.delete(self._key(token))


def open_rendezvous(redis_client: aioredis.Redis | None) -> Rendezvous:
    """The rendezvous beside a process's stores: in Redis when it has a client, else in memory."""
    return RedisRendezvous(redis_client) if redis_client is not None else MemoryRendezvous()
