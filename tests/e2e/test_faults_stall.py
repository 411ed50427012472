"""A transfer that stalls mid-layer, on workers whose clocks are skewed.

The prefill worker that gets frozen (SIGSTOP: its socket stops in the middle of a layer, as a
hung host's would) runs an hour ahead; one decode worker runs an hour behind. Leases are the
coordinator's clock and workers are handed durations, so the skew changes nothing: the stalled
ticket's lease lapses on the coordinator's clock, its reaper expires it and tells the decode
side, which frees the blocks; the request is retried on other workers or fails cleanly (never
hangs). When the frozen worker resumes (SIGCONT), what it still sends for the dead ticket is
refused and not one frame lands (late writes accepted: 0, checksums of every handoff equal,
ledgers exact: ``pdserve audit``). The deterministic version of the late frame (a sender that
never heard of the expiry) is ``test_expiry_mid_transfer``.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from pdserve.api.v1 import worker_pb2, worker_pb2_grpc

from .conftest import ServiceProcess
from .faults import (
    Load,
    Stack,
    assert_clean,
    build_stack,
    catch_in_phase,
    failure_reasons,
    settled_audit,
    settled_idle_ledgers,
    summary,
    wait_router_sees,
)

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

HOUR_S = 3600.0
WORKER_ARGS = ("--speedup", "1", "--num-kv-layers", "4", "--max-num-blocks", "1024",
               "--kv-scale", "0.5")
"""Half the real KV size: a layer of a 1,000-token prompt is about 4 MB, more than a socket
buffer holds, so a frozen sender stops in the middle of one."""
LEASE_S = 2.0


def _refused_frames(workers: list[ServiceProcess]) -> int:
    total = 0
    for worker in workers:
        with grpc.insecure_channel(worker.grpc_address) as channel:
            total += worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=5).num_refused_frames
    return total


async def test_a_frozen_sender_on_skewed_clocks_is_fenced_off_and_its_request_retried(
        e2e_redis_url: str, e2e_database_url: str, processes: list[ServiceProcess]) -> None:
    stack: Stack = await asyncio.to_thread(
        build_stack, processes, e2e_redis_url, e2e_database_url, num_prefill=1, num_decode=1,
        pool_args=("--heartbeat-timeout-s", "2"),
        router_args=("--lease-s", str(LEASE_S)), worker_args=WORKER_ARGS)
    skewed = {"PDSERVE_TEST_CLOCK_OFFSET_S": str(HOUR_S)}
    stack.prefill_workers.append(stack.start_worker("prefill", "prefill-ahead", skewed))
    stack.decode_workers.append(stack.start_worker(
        "decode", "decode-behind", {"PDSERVE_TEST_CLOCK_OFFSET_S": str(-HOUR_S)}))
    for worker in stack.workers:
        await asyncio.to_thread(worker.wait_ready)
    await asyncio.to_thread(wait_router_sees, stack.routers[0], 2, 2)
    victim = stack.prefill_workers[-1]
    assert "wall clock skewed" in victim.output

    refused_before = await asyncio.to_thread(_refused_frames, stack.decode_workers)
    load = Load(stack.router_addresses, concurrency=3, max_tokens=16,
                prompt_tokens=(800, 1500)).start()
    try:
        await asyncio.to_thread(catch_in_phase, [victim], "sending")
        os.killpg(victim.pid, signal.SIGSTOP)
        await asyncio.sleep(3 * LEASE_S)  # the lease lapses; the pool marks the worker FAILED
    finally:
        os.killpg(victim.pid, signal.SIGCONT)
    await asyncio.sleep(3.0)  # the resumed sender's stalled frames arrive (and are refused)
    outcomes = await load.stop()
    print(f"frozen sender: {summary(outcomes)} {failure_reasons(outcomes)}")

    assert summary(outcomes)["completed"] > 0
    assert_clean(outcomes)  # retried or failed cleanly: none hung, none cut short
    expired = [line for line in stack.coordinators[0].lines if "expired" in line]
    assert expired, "the frozen transfer's ticket did not expire on the coordinator"
    assert any(victim.worker_id in line or "failed before the first token" in line
               for line in stack.routers[0].lines), "no request was retried"
    refused = await asyncio.to_thread(_refused_frames, stack.decode_workers)
    # Whether the resumed sender still pushes frames (refused: the ticket ended) or first reads
    # the receiver's ERROR and stops depends on where SIGSTOP caught it; either way no byte of
    # them may land (late writes accepted: 0, below).
    print(f"frames refused after the freeze: {refused - refused_before}")
    # The resumed worker is taken back (re-adopted) and every worker serves again.
    await asyncio.to_thread(wait_router_sees, stack.routers[0], 2, 2, 30.0)
    report = await settled_audit(stack)
    assert report.is_ok, report
    assert report.late_writes_accepted == 0
    assert report.num_checksums_compared > 0
    assert not await settled_idle_ledgers(stack)
