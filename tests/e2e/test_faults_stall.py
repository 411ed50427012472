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
from collections.abc import Iterator

import grpc
import pytest

from pdserve.api.v1 import worker_pb2, worker_pb2_grpc

from .conftest import ServiceProcess
from .faults import (
    HANG_S,
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
IDLE_S = 3.0
"""The router's stream idle timeout: a frozen decode stream ends after this long."""


def _refused_frames(workers: list[ServiceProcess]) -> int:
    total = 0
    for worker in workers:
        with grpc.insecure_channel(worker.grpc_address) as channel:
            total += worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=5).num_refused_frames
    return total


@pytest.fixture(scope="module")
def stack(e2e_redis_url: str, e2e_database_url: str,
          processes: list[ServiceProcess]) -> Iterator[Stack]:
    """One prefill and one decode worker on the true clock, one of each skewed by an hour."""
    built = build_stack(processes, e2e_redis_url, e2e_database_url, num_prefill=1, num_decode=1,
                        pool_args=("--heartbeat-timeout-s", "2"),
                        router_args=("--lease-s", str(LEASE_S), "--stream-idle-timeout-s",
                                     str(IDLE_S)),
                        worker_args=WORKER_ARGS)
    built.prefill_workers.append(built.start_worker(
        "prefill", "prefill-ahead", {"PDSERVE_TEST_CLOCK_OFFSET_S": str(HOUR_S)}))
    built.decode_workers.append(built.start_worker(
        "decode", "decode-behind", {"PDSERVE_TEST_CLOCK_OFFSET_S": str(-HOUR_S)}))
    for worker in built.workers:
        worker.wait_ready()
    wait_router_sees(built.routers[0], 2, 2)
    yield built


async def test_a_frozen_sender_on_skewed_clocks_is_fenced_off_and_its_request_retried(
        stack: Stack) -> None:
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


async def test_a_frozen_decode_worker_ends_its_streams_cleanly_and_is_taken_back(
        stack: Stack) -> None:
    """SIGSTOP of a decode worker mid-decode: its streams stop with no error from the network
    (the process is alive, its sockets open). The router's idle timeout ends them with
    DEADLINE_EXCEEDED (past the first token) or retries them elsewhere (before it) long before
    a client would call them hung; resumed, the worker is taken back and its ledger is exact."""
    load = Load(stack.router_addresses, concurrency=3, max_tokens=64,
                prompt_tokens=(100, 400)).start()
    victim = await asyncio.to_thread(catch_in_phase, stack.decode_workers, "decoding")
    os.killpg(victim.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(2 * IDLE_S)
    finally:
        os.killpg(victim.pid, signal.SIGCONT)
    await asyncio.sleep(2.0)
    outcomes = await load.stop()
    print(f"frozen decode worker: {summary(outcomes)} {failure_reasons(outcomes)}")

    assert summary(outcomes)["completed"] > 0
    assert_clean(outcomes)
    failed = [o for o in outcomes if o.kind == "failed"]
    assert failed, "no stream was on the frozen worker"
    assert all(o.num_tokens > 0 and o.code == "DEADLINE_EXCEEDED" for o in failed), failed[:3]
    assert all(o.ended_s - o.started_s < HANG_S / 2 for o in failed)
    await asyncio.to_thread(wait_router_sees, stack.routers[0], 2, 2, 30.0)
    report = await settled_audit(stack)
    assert report.is_ok, report
    assert not await settled_idle_ledgers(stack)
