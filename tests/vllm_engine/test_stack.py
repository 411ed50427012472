"""The whole stack on vLLM (``stack_support``), its KV over tcp: the workers' lifecycle, the
token-exact handoff, heartbeats, a lease that lapses mid-transfer, kill -9 of a worker mid-handoff,
and an engine that dies.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import pytest_asyncio
from e2e.conftest import ServiceProcess
from e2e.faults import list_workers, settled_audit, wait_router_sees
from stack_support import (
    ALL_PROMPTS,
    BLOCK_SIZE,
    KILL_PROMPT,
    LAPSE_PROMPT,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    VllmStack,
    _command_of,
    _engine_pids,
    _generate,
    _prompt,
    _wait_for,
    check_token_exact_and_checksummed,
    start_vllm_stack,
)

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.common.grpc_client import channel_target
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.transports.tcp.sender import TcpKvSender
from pdserve.worker.transports.values import KvDestinationSpec, TransferFailedError

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_stack(tiny_model_dir: Path, e2e_redis_url: str, e2e_database_url: str,
                     processes: list[ServiceProcess]) -> AsyncIterator[VllmStack]:
    yield await start_vllm_stack(tiny_model_dir, e2e_redis_url, e2e_database_url, processes)


# ---- the tests ------------------------------------------------------------------------------


async def test_workers_load_then_report_vllms_capacity(vllm_stack: VllmStack) -> None:
    assert vllm_stack.seen_loading  # registered LOADING while vLLM loaded, READY after
    for role in ("prefill", "decode"):
        info = vllm_stack.worker(role)
        assert info.engine == "vllm" and info.state == pb.WORKER_STATE_READY
        assert info.kv_layout.block_size_tokens == BLOCK_SIZE
        assert info.kv_layout.num_layers == 4
        # vLLM's own numbers (it keeps one of its blocks as the null block), registered again
        # once it had loaded: layout, capacity and context limit are the engine's.
        assert info.load.num_total_blocks == info.kv_layout.num_blocks == NUM_BLOCKS - 1
        assert info.max_model_len == MAX_MODEL_LEN  # vLLM's, below the model's 512+


async def test_handoff_is_token_exact_and_checksummed(vllm_stack: VllmStack) -> None:
    await check_token_exact_and_checksummed(vllm_stack)


async def test_heartbeats_carry_vllms_load(vllm_stack: VllmStack) -> None:
    # The decode engine is paused (SIGSTOP of its processes) while the request is mid-decode,
    # its scheduler's last stats showing the sequence running; the heartbeats then report that
    # load however fast the engine decodes (on a quiet machine the whole request can end within
    # one heartbeat interval). The worker's agent, which heartbeats, is not paused.
    engines = _engine_pids(vllm_stack.decode)
    assert engines, "the decode worker runs no engine process"
    busy: list[pb.WorkerLoad] = []

    async def running() -> bool:
        load = vllm_stack.worker("decode").load
        if load.num_running_seqs >= 1:
            busy.append(load)
        return bool(busy)

    async def pause_once(tokens: list[int]) -> None:
        if not busy and len(tokens) >= 2:  # the decode engine is producing
            _signal_all(engines, signal.SIGSTOP)
            try:
                await _wait_for(running, 60.0, "a heartbeat showing the running sequence")
            finally:
                _signal_all(engines, signal.SIGCONT)

    reply = await _generate(vllm_stack, _prompt(60, 20), max_tokens=420, timeout_s=300,
                            on_tokens=pause_once)
    assert reply.error is None and len(reply.tokens) == 420
    assert busy, "the request ended before any heartbeat saw it"
    # vLLM's own block accounting: the running sequence holds at least its prompt's blocks.
    assert busy[0].num_total_blocks == NUM_BLOCKS - 1
    assert busy[0].num_free_blocks <= NUM_BLOCKS - 1 - math.ceil(60 / BLOCK_SIZE)


async def _open_ticket(stack: VllmStack) -> kv_transfer_pb2.Ticket:
    target, options = channel_target(stack.stack.coordinator_address)
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        live = (pb.TICKET_STATE_OPEN, pb.TICKET_STATE_PREFILLING, pb.TICKET_STATE_TRANSFERRING)
        while True:
            # Any live ticket: the prefill worker may already have reported PREFILLING.
            tickets = [t for t in (await stub.ListTickets(kv_transfer_pb2.ListTicketsRequest(
                decode_worker_id=stack.worker("decode").worker_id), timeout=5)).tickets
                if t.state in live]
            if tickets:
                return tickets[0]
            await asyncio.sleep(0.05)


async def _destination(stack: VllmStack, token: pb.FencingToken) -> KvDestinationSpec:
    target, options = channel_target(stack.stack.coordinator_address)
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        response = await stub.AwaitDestination(kv_transfer_pb2.AwaitDestinationRequest(
            token=token, timeout_ms=20_000), timeout=30)
    assert response.is_ready, "the decode engine did not place the prompt"
    return KvDestinationSpec.from_proto(response.destination)


def _signal_all(pids: set[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


async def _free_blocks(stack: VllmStack) -> int:
    status = await stack.status("decode")
    return status.num_total_blocks - status.num_used_blocks


async def test_lease_lapse_mid_transfer_frees_vllms_blocks_and_refuses_late_frames(
        vllm_stack: VllmStack) -> None:
    idle_free = await _free_blocks(vllm_stack)
    engines = _engine_pids(vllm_stack.prefill)
    assert engines, "the prefill worker runs no engine process"
    # The prefill engine stalls (its agent keeps heartbeating); this test plays its sender,
    # which gets half of the prompt's layers in before the lease lapses.
    _signal_all(engines, signal.SIGSTOP)
    try:
        request = asyncio.create_task(_generate(vllm_stack, LAPSE_PROMPT, timeout_s=120))
        ticket = await asyncio.wait_for(_open_ticket(vllm_stack), 30)
        destination = await _destination(vllm_stack, ticket.token)
        token = FencingToken(ticket.token.ticket_id, ticket.token.attempt)
        garbage = KvCache(destination.layout)
        rng = np.random.default_rng(0)
        for buffer in garbage.layer_buffers:
            buffer[:] = rng.integers(0, 256, size=buffer.shape, dtype=np.uint8)
        src = list(range(len(destination.block_ids)))
        sender = TcpKvSender(garbage)
        await sender.open(destination, token)
        await sender.offer_layers(range(destination.layout.num_layers // 2), src)
        refused_before = (await vllm_stack.status("decode")).num_refused_frames

        # The lease lapses: the coordinator expires the ticket, the decode worker drops it,
        # vLLM frees its blocks; the request is retried or fails cleanly, never hangs.
        reply = await asyncio.wait_for(request, 120)
        assert reply.error is not None or reply.tokens == vllm_stack.reference["lapse"]

        async def blocks_back() -> bool:
            return await _free_blocks(vllm_stack) == idle_free

        await _wait_for(blocks_back, 30.0, "the decode engine's free blocks back to idle")
        with pytest.raises(TransferFailedError):  # the rest of this transfer is refused
            await sender.offer_layers(range(destination.layout.num_layers // 2,
                                            destination.layout.num_layers), src)
            await sender.finish(0, 0.0)
        await sender.close()
        late = TcpKvSender(garbage)  # and so is a late sender of the same ticket, counted
        with pytest.raises(TransferFailedError):
            await late.open(destination, token)
            await late.offer_layers(range(destination.layout.num_layers), src)
            await late.finish(0, 0.0)
        await late.close()

        async def refused() -> bool:
            return (await vllm_stack.status("decode")).num_refused_frames > refused_before

        await _wait_for(refused, 10.0, "the late frames counted as refused")
    finally:
        _signal_all(engines, signal.SIGCONT)
    await asyncio.to_thread(wait_router_sees, vllm_stack.stack.routers[0], 1, 1, 60.0)
    # No half-written block was cached: the same prompt again gives the reference output.
    again = await _generate(vllm_stack, LAPSE_PROMPT)
    assert again.error is None and again.tokens == vllm_stack.reference["lapse"]
    assert (await vllm_stack.status("decode")).num_late_writes_accepted == 0


async def test_kill_9_of_the_prefill_worker_mid_handoff_leaves_no_engine_or_block(
        vllm_stack: VllmStack) -> None:
    engines = _engine_pids(vllm_stack.prefill)
    assert engines
    _signal_all(engines, signal.SIGSTOP)  # the handoff is in flight when the worker dies
    request = asyncio.create_task(_generate(vllm_stack, KILL_PROMPT, timeout_s=120))
    await asyncio.wait_for(_open_ticket(vllm_stack), 30)
    os.kill(vllm_stack.prefill.pid, signal.SIGKILL)  # the agent only: its engine must follow
    _signal_all(engines, signal.SIGCONT)
    reply = await asyncio.wait_for(request, 120)
    assert reply.error is not None or reply.tokens == vllm_stack.reference["kill"]

    def orphans() -> set[int]:
        return {pid for pid in engines if Path(f"/proc/{pid}").exists()
                and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()}

    deadline = time.monotonic() + 15
    while orphans() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert not orphans(), "engine processes outlived their killed agent"
    report = await settled_audit(vllm_stack.stack, settle_s=30.0)
    assert report.leaked_blocks == 0, report
    assert not report.checksum_mismatches and report.late_writes_accepted == 0, report


async def test_an_engine_that_dies_fails_its_worker(vllm_stack: VllmStack) -> None:
    cores = [pid for pid in _engine_pids(vllm_stack.decode)
             if "EngineCore" in _command_of(pid)]
    assert cores
    os.kill(cores[0], signal.SIGKILL)  # vLLM's EngineCore, not the agent

    async def failed() -> bool:
        workers = [w for w in list_workers(vllm_stack.stack.pool_address("decode"))
                   if w.role == pb.WORKER_ROLE_DECODE]
        return any(w.state == pb.WORKER_STATE_FAILED for w in workers) or not workers

    await _wait_for(failed, 60.0, "the decode worker reported FAILED")
    assert await asyncio.to_thread(vllm_stack.decode.wait_exit, 30.0) != 0


@pytest.fixture(autouse=True)
def _no_stale_reference(vllm_stack: VllmStack) -> Iterator[None]:
    assert len(vllm_stack.reference) == len(ALL_PROMPTS)
    yield
