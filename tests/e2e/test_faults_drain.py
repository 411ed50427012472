"""Drain-correct scale-down under steady load, through the path the governor takes: the pool
managers (two replicas each, provisioning their own workers; only the holder of the pool's
actuation lease acts) are told ``SetTargetSize`` half of what runs. The chosen workers take no
new work (the router skips non-READY workers, a draining worker answers UNAVAILABLE to new
admits and the router retries elsewhere), a prefill worker leaves once its tickets are done and
a decode worker once its streams end. Not one request fails, and the ledgers are exact."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import pool_pb2, pool_pb2_grpc
from pdserve.common.grpc_client import channel_target

from .conftest import ServiceProcess
from .faults import (
    MODEL,
    Load,
    Stack,
    assert_clean,
    build_stack,
    failure_reasons,
    list_workers,
    settled_audit,
    settled_idle_ledgers,
    summary,
    wait_router_sees,
    wait_until,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

NUM_WORKERS = 4
PROVISIONED_WORKER_ARGS = (
    "--pool-address {pool} --coordinator-address {coordinator} --service-name {role}-worker "
    "--speedup 1 --num-kv-layers 4 --max-num-blocks 2048")
"""Real-time simulated H100s: streams last long enough that drains meet work in flight."""


def _set_target(stack: Stack, role: str, num_workers: int) -> None:
    target, options = channel_target(stack.pool_address(role))
    with grpc.insecure_channel(target, options=options) as channel:
        pool_pb2_grpc.PoolServiceStub(channel).SetTargetSize(pool_pb2.SetTargetSizeRequest(
            deployment=MODEL, num_workers=num_workers, set_by="governor",
            role=pb.WORKER_ROLE_PREFILL if role == "prefill" else pb.WORKER_ROLE_DECODE),
            timeout=10)


def _states(stack: Stack) -> collections.Counter[tuple[int, int]]:
    return collections.Counter(
        (w.role, w.state) for w in list_workers(stack.pool_address("decode"))
    )


async def test_removing_half_of_each_pool_under_load_fails_no_request(
        e2e_redis_url: str, e2e_database_url: str, processes: list[ServiceProcess]) -> None:
    stack = await asyncio.to_thread(
        build_stack, processes, e2e_redis_url, e2e_database_url, num_replicas=2, num_routers=2,
        num_prefill=0, num_decode=0,
        pool_args=("--is-provisioning", "--initial-target-size", str(NUM_WORKERS),
                   "--worker-args", PROVISIONED_WORKER_ARGS))
    for router in stack.routers:
        await asyncio.to_thread(wait_router_sees, router, NUM_WORKERS, NUM_WORKERS, 60.0)
    launched = {w.worker_id for w in list_workers(stack.pool_address("decode"))}
    # One replica of each pool holds the actuation lease: exactly the target was launched.
    assert len(launched) == 2 * NUM_WORKERS, _states(stack)

    load = Load(stack.router_addresses, concurrency=6, max_tokens=32,
                prompt_tokens=(200, 1200)).start()
    await asyncio.sleep(2.0)
    for role in ("prefill", "decode"):
        await asyncio.to_thread(_set_target, stack, role, NUM_WORKERS // 2)
    ready = (pb.WORKER_ROLE_PREFILL, pb.WORKER_STATE_READY), (pb.WORKER_ROLE_DECODE,
                                                              pb.WORKER_STATE_READY)
    is_halved = await asyncio.to_thread(wait_until, lambda: (
        len(list_workers(stack.pool_address("decode"))) == NUM_WORKERS
        and all(_states(stack)[key] == NUM_WORKERS // 2 for key in ready)), 60.0, 0.25)
    await asyncio.sleep(2.0)  # keep serving on the smaller pools
    outcomes = await load.stop()
    print(f"scale-down: {summary(outcomes)} {failure_reasons(outcomes)}; states {_states(stack)}")

    assert is_halved, f"pools did not shrink to {NUM_WORKERS // 2} each: {_states(stack)}"
    assert summary(outcomes)["completed"] > 0
    assert_clean(outcomes, max_failed=0)
    remaining = {w.worker_id for w in list_workers(stack.pool_address("decode"))}
    assert remaining < launched  # the same workers, minus the drained ones
    for router in stack.routers:
        await asyncio.to_thread(wait_router_sees, router, NUM_WORKERS // 2, NUM_WORKERS // 2)
    report = await settled_audit(stack)
    assert report.is_ok, str(report)
    assert not await settled_idle_ledgers(stack)
