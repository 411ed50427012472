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
    wait_until,
)

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

HOUR_S = 3600.0
MAX_PREFILL_STALL_S = 1.0
WORKER_ARGS = ("--speedup", "1", "--num-kv-layers", "4", "--max-num-blocks", "1024",
               "--kv-scale", "0.5", "--test-prefill-hold-signals", "true",
               "--max-prefill-stall-s", str(MAX_PREFILL_STALL_S))
"""Half the real KV size: a layer of a 1,000-token prompt is about 4 MB, more than a socket
buffer holds, so a frozen sender stops in the middle of one. SIGUSR1/SIGUSR2 hold and release
a worker's prefill loop (the stalled-loop test)."""
LEASE_S = 2.0
IDLE_S = 3.0
"""The router's stream idle timeout: a frozen decode stream ends after this long."""


def _queued_tickets(worker: ServiceProcess) -> set[str]:
    with grpc.insecure_channel(worker.grpc_address) as channel:
        status = worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
            worker_pb2.GetStatusRequest(), timeout=5)
    return {t.token.ticket_id for t in status.tickets if t.phase == "queued"}


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
    assert report.is_ok, str(report)
    assert report.late_writes_accepted == 0
    assert report.num_checksums_compared > 0
    assert not await settled_idle_ledgers(stack)


async def test_a_frozen_decode_worker_ends_its_streams_cleanly_and_is_taken_back(
        stack: Stack) -> None:
    """SIGSTOP of a decode worker mid-decode: its streams stop with no error from the network
    (the process is alive, its sockets open). The router's idle timeout (or the pool declaring
    the worker failed) ends them: past the first token they fail over to the other decode worker
    (or, if the router gives up within its bounds, the client resumes them), before it they are
    retried elsewhere, long before a client would call them hung: every stream completes.
    Resumed, the worker is taken back and its ledger is exact."""
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
    assert not [o for o in outcomes if o.kind == "failed"], failure_reasons(outcomes)
    # Moved off the frozen worker by the router (a failover) or, where the router gave up
    # within its failover bounds, by the client resuming with the tokens it had.
    moved = [o for o in outcomes if o.num_failovers or o.num_resumes]
    assert moved, "no stream was moved off the frozen worker"
    assert all(o.ended_s - o.started_s < HANG_S / 2 for o in moved)
    await asyncio.to_thread(wait_router_sees, stack.routers[0], 2, 2, 30.0)
    report = await settled_audit(stack)
    assert report.is_ok, str(report)
    assert not await settled_idle_ledgers(stack)


async def test_a_stalled_prefill_loop_lets_its_queued_leases_lapse_and_the_requests_retry(
        stack: Stack) -> None:
    """The prefill loop of a live worker stops advancing (held: as a hung engine or transport
    would hold it) while its heartbeats go on, so the pool keeps it READY. Its queued prompts'
    leases are no longer renewed once the loop has not advanced for ``MAX_PREFILL_STALL_S``:
    the coordinator expires those tickets within a lease, tells the worker (they leave its
    queue while the loop is still held) and the router retries the requests elsewhere; none
    hangs. Before the watermark, renewal on the heartbeat kept them queued for as long as the
    loop hung."""
    victim = stack.prefill_workers[0]
    load = Load(stack.router_addresses, concurrency=4, max_tokens=8,
                prompt_tokens=(200, 600)).start()
    try:
        os.killpg(victim.pid, signal.SIGUSR1)
        await asyncio.to_thread(catch_in_phase, [victim], "queued")
        stuck = await asyncio.to_thread(_queued_tickets, victim)
        assert stuck
        # Stall bound + one lease + the reaper's pass; far inside the hang bound.
        bound_s = MAX_PREFILL_STALL_S + 3 * LEASE_S + 2.0
        is_gone = await asyncio.to_thread(
            wait_until, lambda: not (_queued_tickets(victim) & stuck), bound_s)
        assert is_gone, f"queued tickets {stuck} still queued after {bound_s:.0f} s of stall"
    finally:
        os.killpg(victim.pid, signal.SIGUSR2)
    outcomes = await load.stop()
    print(f"stalled prefill loop: {summary(outcomes)} {failure_reasons(outcomes)}")

    assert summary(outcomes)["completed"] > 0
    assert_clean(outcomes)
    assert all(o.ended_s - o.started_s < HANG_S / 2 for o in outcomes)
    expired = [line for line in stack.coordinators[0].lines if "expired" in line]
    assert any(ticket_id in line for line in expired for ticket_id in stuck), (
        "no queued ticket of the stalled loop expired on the coordinator")
    assert "prefill loop stalled" in victim.output
    await asyncio.to_thread(wait_router_sees, stack.routers[0], 2, 2, 30.0)
    report = await settled_audit(stack)
    assert report.is_ok, str(report)
    assert not await settled_idle_ledgers(stack)
