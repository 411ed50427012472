"""The whole stack on highly available Redis: a Redis Cluster (3 masters + 3 replicas) and a
master behind Sentinel (``replica_acks=1``), each failed over under steady load. No request is
lost: every one ends with all its tokens or, at worst, a clean error (none hangs or is
truncated), serving goes on after the failover, and the ledgers are exact afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from helpers.private_redis_ha import (
    PrivateRedisCluster,
    PrivateSentinel,
    private_redis_cluster,
    private_sentinel,
)

from .conftest import ServiceProcess
from .faults import (
    Load,
    assert_clean,
    build_stack,
    failure_reasons,
    settled_audit,
    settled_idle_ledgers,
    summary,
)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture
def cluster() -> Iterator[PrivateRedisCluster]:
    with private_redis_cluster() as server:
        yield server


@pytest.fixture
def sentinel() -> Iterator[PrivateSentinel]:
    with private_sentinel() as server:
        yield server


async def _serve_through(url: str, database_url: str, processes: list[ServiceProcess],
                         fail_over: Callable[[], Awaitable[None]], what: str) -> None:
    stack = await asyncio.to_thread(build_stack, processes, url, database_url)
    load = Load(stack.router_addresses, concurrency=3, pause_s=0.05).start()
    await asyncio.sleep(2.0)
    failed_over_at = time.monotonic()
    await fail_over()
    await asyncio.sleep(3.0)  # serve a while after the failover
    outcomes = await load.stop()
    print(f"{what} failover under load: {time.monotonic() - failed_over_at:.1f}s; "
          f"outcomes {summary(outcomes)} {failure_reasons(outcomes)}")
    after = [o for o in outcomes if o.started_s > failed_over_at and o.kind == "completed"]
    assert after, f"no request started after the failover completed: {summary(outcomes)}"
    assert_clean(outcomes, max_failed=0)
    assert all(p.returncode is None for p in processes)
    report = await settled_audit(stack)
    assert report.is_ok, str(report)
    assert not await settled_idle_ledgers(stack)


async def test_a_cluster_master_fails_over_under_load_and_no_request_is_lost(
        cluster: PrivateRedisCluster, e2e_database_url: str,
        processes: list[ServiceProcess]) -> None:
    async def fail_over() -> None:
        for master in cluster.master_ports():  # every slot changes master once
            await asyncio.to_thread(cluster.fail_over, master)

    await _serve_through(cluster.url, e2e_database_url, processes, fail_over, "cluster")


async def test_a_sentinel_failover_under_load_loses_no_request(
        sentinel: PrivateSentinel, e2e_database_url: str,
        processes: list[ServiceProcess]) -> None:
    async def fail_over() -> None:
        await asyncio.to_thread(sentinel.fail_over)

    await _serve_through(sentinel.url, e2e_database_url, processes, fail_over, "sentinel")
