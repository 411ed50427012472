"""Redis restart under light load: every key is gone (no persistence). Pools, ledgers and
tickets are rebuilt from the workers' heartbeats and serving resumes without restarting any
process; requests in flight end with their tokens or a clean error, none hangs or is truncated,
and the ledgers are exact afterwards (``pdserve audit``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from helpers.private_redis import PrivateRedis, private_redis

from .conftest import ServiceProcess
from .faults import (
    Load,
    assert_clean,
    build_stack,
    failure_reasons,
    ready_counts,
    ready_in_store,
    settled_audit,
    settled_idle_ledgers,
    summary,
    wait_until,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

HEARTBEAT_S = 1.0
"""The pool managers' default heartbeat period."""
RECOVERY_BOUND_S = 15 * HEARTBEAT_S
"""'A few heartbeat periods', with room for a loaded 2-core CI machine."""


@pytest.fixture(scope="module")
def redis_server() -> Iterator[PrivateRedis]:
    with private_redis() as server:
        yield server


async def test_a_redis_restart_is_survived_without_restarting_any_process(
        redis_server: PrivateRedis, e2e_database_url: str,
        processes: list[ServiceProcess]) -> None:
    stack = await asyncio.to_thread(build_stack, processes, redis_server.url, e2e_database_url)
    load = Load(stack.router_addresses, concurrency=3, pause_s=0.05).start()
    await asyncio.sleep(2.0)
    num_before = len(load.outcomes)

    restarted_at = time.monotonic()
    await asyncio.to_thread(redis_server.restart)
    store_ready = await asyncio.to_thread(
        wait_until, lambda: ready_in_store(stack.pool_address("prefill")) == 4, 60.0)
    store_ready_s = time.monotonic() - restarted_at
    view_ready = await asyncio.to_thread(
        wait_until, lambda: ready_counts(stack.routers[0].grpc_address) == (2, 2), 30.0)
    view_ready_s = time.monotonic() - restarted_at
    await asyncio.sleep(3.0)  # serve a while after the restart
    outcomes = await load.stop()

    assert num_before > 0, "no request finished before the restart"
    assert store_ready, f"workers not READY in the store again\n{stack.prefill_pools[0].describe()}"
    assert view_ready
    after = [o for o in outcomes if o.started_s > restarted_at and o.kind == "completed"]
    assert after, f"no request started after the restart completed: {summary(outcomes)}"
    recovery_s = min(o.ended_s for o in after) - restarted_at
    print(f"redis restart: first success after {recovery_s:.2f}s, all workers READY in the store"
          f" after {store_ready_s:.2f}s and in the router's view after {view_ready_s:.2f}s; "
          f"outcomes {summary(outcomes)} {failure_reasons(outcomes)}")
    assert recovery_s < RECOVERY_BOUND_S, (recovery_s, summary(outcomes))
    assert_clean(outcomes)
    # No process was restarted: the same ones are still running.
    assert all(p.returncode is None for p in processes), [p.name for p in processes
                                                          if p.returncode is not None]

    report = await settled_audit(stack)
    assert report.is_ok, str(report)
    assert report.num_checksums_compared > 0
    assert not await settled_idle_ledgers(stack)
