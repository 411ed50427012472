"""Leases for one-at-a-time work (pool actuation, the governor's autoscaler) on real Redis:
one holder at a time, a standby takes over once the holder stops renewing, fencing tokens only
grow (also across a Redis restart that lost the counter), a deposed holder steps down."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from helpers.private_redis import private_redis

from pdserve.common.leadership import LeaderElector, MemoryLease, RedisLease

TTL_S = 0.6


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_one_holder_at_a_time_and_a_standby_takes_over_after_the_lease_lapses(
        client: aioredis.Redis) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    first = LeaderElector(RedisLease(client, name, "a"), TTL_S)
    second = LeaderElector(RedisLease(client, name, "b"), TTL_S)
    assert await first.step() and not await second.step()
    token = first.token
    assert token is not None
    assert await RedisLease(client, name, "x").current_holder() == "a"
    for _ in range(4):  # the holder renews, the standby keeps trying
        await asyncio.sleep(TTL_S / 3)
        assert await first.step() and not await second.step()
    # "a" dies (stops renewing); "b" gets the lease once it lapses.
    loop = asyncio.get_running_loop()
    died_at = loop.time()
    while not await second.step():
        assert loop.time() - died_at < 3 * TTL_S, "standby did not take over"
        await asyncio.sleep(TTL_S / 3)
    assert second.token is not None and second.token > token
    # The deposed holder learns at its next renewal and steps down.
    assert not await first.step()
    assert first.token is None


async def test_fencing_tokens_keep_growing_across_a_redis_restart() -> None:
    with private_redis() as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            lease = RedisLease(client, "restart", "a")
            before = await lease.acquire(TTL_S)
            await lease.release(before)  # type: ignore[arg-type]
            await client.aclose()
            server.restart()
            client = aioredis.Redis.from_url(server.url)
            after = await RedisLease(client, "restart", "b").acquire(TTL_S)
            assert before is not None and after is not None and after > before
        finally:
            await client.aclose()


async def test_release_frees_the_lease_at_once_and_only_for_its_holder(
        client: aioredis.Redis) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    a, b = RedisLease(client, name, "a"), RedisLease(client, name, "b")
    token = await a.acquire(10.0)
    assert token is not None and await b.acquire(10.0) is None
    await b.release(token)  # not b's: no effect
    assert await b.acquire(10.0) is None
    await a.release(token)
    assert await b.acquire(10.0) is not None


async def test_memory_lease_has_the_same_rules() -> None:
    now = [0.0]
    table: dict[str, tuple[str, int, float]] = {}
    a = MemoryLease("m", "a", table, clock=lambda: now[0])
    b = MemoryLease("m", "b", table, clock=lambda: now[0])
    token = await a.acquire(1.0)
    assert token == 1 and await b.acquire(1.0) is None
    assert await a.renew(1, 1.0)
    now[0] = 2.5
    assert await b.acquire(1.0) == 2
    assert not await a.renew(1, 1.0)
