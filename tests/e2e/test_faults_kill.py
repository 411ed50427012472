"""kill -9 under steady load, one process at a time, on a stack whose control plane runs as two
replicas of everything (coordinator, each pool manager, router):

- a prefill worker mid-prefill and mid-transfer, a decode worker mid-decode;
- a coordinator, a pool manager and a router replica (each restarted on its port afterwards).

Every request ends with its tokens (none fails, hangs or is truncated): a failure before the
first token is retried on other workers, a stream whose decode worker dies fails over to another
one, and one whose router replica dies is resumed by the client on the other replica; after the
stack settles every decode ledger is exact and the handoff checksums agree (``pdserve audit``),
no ticket is left behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from .conftest import ServiceProcess
from .faults import (
    Load,
    Outcome,
    Stack,
    assert_clean,
    build_stack,
    catch_in_phase,
    failure_reasons,
    kill9,
    settled_audit,
    settled_idle_ledgers,
    summary,
    wait_router_sees,
    wait_until,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

WORKER_ARGS = ("--speedup", "1", "--num-kv-layers", "4", "--max-num-blocks", "2048")
"""Real-time simulated H100s: a 600-token prefill takes tens of milliseconds and 32 tokens of
decode a few hundred, long enough to catch a worker in the middle of each phase."""
MAX_TOKENS = 32
LOAD_AFTER_FAULT_S = 2.5


@pytest.fixture(scope="module")
def stack(e2e_redis_url: str, e2e_database_url: str,
          processes: list[ServiceProcess]) -> Iterator[Stack]:
    yield build_stack(processes, e2e_redis_url, e2e_database_url, num_replicas=2,
                      pool_args=("--heartbeat-timeout-s", "2"),
                      router_args=("--lease-s", "3"), worker_args=WORKER_ARGS)


async def _under_load(stack: Stack, fault: Callable[[], object],
                      after_s: float = LOAD_AFTER_FAULT_S) -> list[Outcome]:
    load = Load(stack.router_addresses, concurrency=4, max_tokens=MAX_TOKENS,
                prompt_tokens=(300, 1500)).start()
    await asyncio.sleep(1.0)
    await asyncio.to_thread(fault)
    await asyncio.sleep(after_s)
    return await load.stop()


async def _assert_settled(stack: Stack) -> None:
    report = await settled_audit(stack)
    assert report.is_ok, str(report)
    assert not await settled_idle_ledgers(stack)


def _replace_worker(stack: Stack, victim: ServiceProcess) -> None:
    group = stack.prefill_workers if victim in stack.prefill_workers else stack.decode_workers
    role = "prefill" if group is stack.prefill_workers else "decode"
    group[group.index(victim)] = replacement = stack.start_worker(role, f"{victim.name}-r")
    replacement.wait_ready()
    for router in stack.routers:
        wait_router_sees(router, len(stack.prefill_workers), len(stack.decode_workers))


def _check(outcomes: list[Outcome], what: str) -> None:
    print(f"{what}: {summary(outcomes)} {failure_reasons(outcomes)}")
    assert summary(outcomes)["completed"] > 0
    assert_clean(outcomes)
    early = [o for o in outcomes if o.kind == "failed" and o.num_tokens == 0]
    assert not early, f"failed before the first token (should have been retried): {early[:3]}"


@pytest.mark.parametrize("phase", ["prefilling", "sending"])
async def test_kill_a_prefill_worker_mid_prefill_or_mid_transfer(stack: Stack, phase: str) -> None:
    victims: list[ServiceProcess] = []

    def fault() -> None:
        victims.append(catch_in_phase(stack.prefill_workers, phase))
        kill9(victims[0])

    outcomes = await _under_load(stack, fault)
    _check(outcomes, f"prefill worker killed while {phase}")
    assert not [o for o in outcomes if o.kind == "failed"], failure_reasons(outcomes)
    await asyncio.to_thread(_replace_worker, stack, victims[0])
    await _assert_settled(stack)


async def test_kill_a_decode_worker_mid_decode(stack: Stack) -> None:
    victims: list[ServiceProcess] = []

    def fault() -> None:
        victims.append(catch_in_phase(stack.decode_workers, "decoding"))
        kill9(victims[0])

    outcomes = await _under_load(stack, fault)
    _check(outcomes, "decode worker killed while decoding")
    assert not [o for o in outcomes if o.kind == "failed"], failure_reasons(outcomes)
    await asyncio.to_thread(_replace_worker, stack, victims[0])
    await _assert_settled(stack)


@pytest.mark.parametrize("service", ["coordinator", "decode-pool", "prefill-pool", "router"])
async def test_kill_a_control_plane_replica_and_restart_it(stack: Stack, service: str) -> None:
    group = {"coordinator": stack.coordinators, "decode-pool": stack.decode_pools,
             "prefill-pool": stack.prefill_pools, "router": stack.routers}[service]
    victim = group[0]
    outcomes = await _under_load(stack, lambda: kill9(victim))
    _check(outcomes, f"{service} replica killed")
    # A killed router's streams are resumed by their clients on the other replica.
    assert not [o for o in outcomes if o.kind == "failed"], failure_reasons(outcomes)
    group[0] = restarted = stack.restart(victim)
    await asyncio.to_thread(restarted.wait_ready)
    if service == "router":
        await asyncio.to_thread(wait_router_sees, restarted, 2, 2)
    # The restarted replica serves: a short load over every replica completes.
    again = await _under_load(stack, lambda: None, after_s=1.0)
    assert_clean(again, max_failed=0)
    await _assert_settled(stack)
    assert await asyncio.to_thread(wait_until, lambda: restarted.returncode is None, 1.0)
