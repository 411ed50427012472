"""The whole stack on vLLM: coordinator, both pool managers and the router as their own processes
on Redis and Postgres, a prefill and a decode worker (``pdserve serve worker --engine vllm``) each
driving a real vLLM engine (CPU build, the float32 tiny Llama), every hop real gRPC, the KV over
pdserve's tcp transport between vLLM's own KV caches. Local prefill is off: every prompt is
computed by the prefill engine and decoded by the decode engine.

The reference is one colocated vLLM engine in this process with the same model, dtype, block
size and context (prefix caching off), run before the stack sees any request.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import pytest
import pytest_asyncio
from e2e.conftest import ServiceProcess
from e2e.faults import MODEL, Stack, build_stack, list_workers, settled_audit, wait_router_sees
from helpers.vllm_env import ENGINE_ENVIRONMENT

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import (
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pdserve.common.grpc_client import channel_target
from pdserve.common.types import FencingToken
from pdserve.worker.engine import KvCache
from pdserve.worker.transports.tcp.sender import TcpKvSender
from pdserve.worker.transports.values import KvDestinationSpec, TransferFailedError

if TYPE_CHECKING:
    from pdserve.worker.engines.vllm.engine import VllmEngine

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

BLOCK_SIZE = 32
MAX_MODEL_LEN = 512
NUM_BLOCKS = 160
NUM_GENERATED = 32
LEASE_S = 5.0
WORKER_START_S = 300.0
"""Two engines loading at once on two cores (plus this process's reference engine)."""


def _prompt(length: int, salt: int) -> list[int]:
    rng = np.random.default_rng(2000 + salt)
    return [int(t) for t in rng.integers(3, 1000, size=length)]


CACHED_PREFIX = _prompt(2 * BLOCK_SIZE, 0)
PROMPTS: dict[str, list[int]] = {
    "one_token": _prompt(1, 1),
    "two_tokens": _prompt(2, 2),
    "block_minus_one": _prompt(BLOCK_SIZE - 1, 3),
    "one_block": _prompt(BLOCK_SIZE, 4),
    "block_plus_one": _prompt(BLOCK_SIZE + 1, 5),
    "two_blocks": _prompt(2 * BLOCK_SIZE, 6),
    "seventy_seven": _prompt(77, 7),
    "hundred_thirty": _prompt(130, 8),
    "two_hundred": _prompt(200, 9),
    "three_hundred_one": _prompt(301, 10),
    "near_limit": _prompt(MAX_MODEL_LEN - NUM_GENERATED - 1, 11),
    "prefix_seed": CACHED_PREFIX + _prompt(20, 12),
}
AFTER_SEED = {"decode_has_prefix": CACHED_PREFIX + _prompt(45, 13)}
"""Sent once ``prefix_seed`` is done: the decode engine holds the shared two blocks."""
LAPSE_PROMPT = _prompt(100, 14)
KILL_PROMPT = _prompt(150, 15)
ALL_PROMPTS = {**PROMPTS, **AFTER_SEED, "lapse": LAPSE_PROMPT, "kill": KILL_PROMPT}


@dataclass
class VllmStack:
    stack: Stack
    prefill: ServiceProcess
    decode: ServiceProcess
    reference: dict[str, list[int]]
    seen_loading: bool

    def worker(self, role: str) -> pb.WorkerInfo:
        wanted = pb.WORKER_ROLE_PREFILL if role == "prefill" else pb.WORKER_ROLE_DECODE
        (info,) = [w for w in list_workers(self.stack.pool_address(role))
                   if w.role == wanted and w.state != pb.WORKER_STATE_FAILED]
        return info

    async def status(self, role: str) -> worker_pb2.GetStatusResponse:
        target, options = channel_target(self.worker(role).address)
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            return await worker_pb2_grpc.WorkerAgentServiceStub(channel).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=10)


async def _colocated(engine: VllmEngine, name: str, prompt: list[int]) -> list[int]:
    from pdserve.worker.engines.vllm.engine import GenerationParams

    tokens: list[int] = []
    params = GenerationParams(max_tokens=NUM_GENERATED, ignore_eos=True)
    async for delta in engine.generate(f"ref-{name}", prompt, params):
        tokens.extend(delta.token_ids)
    return tokens


async def _reference(model_dir: Path) -> dict[str, list[int]]:
    from pdserve.worker.engines.vllm.engine import VllmEngine, VllmEngineSettings

    engine = VllmEngine(VllmEngineSettings(
        model_path=model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN,
        block_size_tokens=BLOCK_SIZE, num_blocks=NUM_BLOCKS, is_prefix_caching_enabled=False,
        environment={**ENGINE_ENVIRONMENT, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}))
    await engine.start()
    try:
        runs = await asyncio.gather(*(_colocated(engine, name, prompt)
                                      for name, prompt in ALL_PROMPTS.items()))
    finally:
        await engine.close()
    return dict(zip(ALL_PROMPTS, runs, strict=True))


def _start_workers(stack: Stack, model_dir: Path) -> tuple[ServiceProcess, ServiceProcess, bool]:
    args = ("--engine", "vllm", "--model-path", str(model_dir), "--vllm-dtype", "float32",
            "--vllm-block-size-tokens", str(BLOCK_SIZE), "--vllm-num-blocks", str(NUM_BLOCKS),
            "--vllm-max-model-len", str(MAX_MODEL_LEN), "--vllm-handoff-timeout-s", "20")
    stack.worker_args = args
    prefill = stack.start_worker("prefill", "vllm-prefill")
    decode = stack.start_worker("decode", "vllm-decode")
    # Registered while vLLM loads: LOADING, until the engine serves.
    seen_loading = False
    deadline = time.monotonic() + WORKER_START_S
    while time.monotonic() < deadline:
        states = {w.state for role in ("prefill", "decode")
                  for w in list_workers(stack.pool_address(role))}
        seen_loading |= pb.WORKER_STATE_LOADING in states
        if states == {pb.WORKER_STATE_READY} and len(states) == 1:
            break
        for process in (prefill, decode):
            assert process.returncode is None, process.describe()
        time.sleep(0.5)
    for process in (prefill, decode):
        process.wait_ready(timeout_s=30.0)
    for router in stack.routers:
        wait_router_sees(router, 1, 1, timeout_s=60.0)
    return prefill, decode, seen_loading


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_stack(tiny_model_dir: Path, e2e_redis_url: str, e2e_database_url: str,
                     processes: list[ServiceProcess]) -> AsyncIterator[VllmStack]:
    reference = await _reference(tiny_model_dir)
    stack = build_stack(processes, e2e_redis_url, e2e_database_url, num_prefill=0,
                        num_decode=0, pool_args=("--heartbeat-timeout-s", "10"),
                        router_args=("--lease-s", str(LEASE_S),
                                     "--local-prefill-threshold-tokens", "0",
                                     # Admission sheds on predicted TTFT; these tests check
                                     # the handoff, not shedding on a two-core machine.
                                     "--is-shedding-enabled", "false"),
                        extra_env=ENGINE_ENVIRONMENT)
    prefill, decode, seen_loading = await asyncio.to_thread(_start_workers, stack,
                                                            tiny_model_dir)
    yield VllmStack(stack, prefill, decode, reference, seen_loading)


@dataclass
class Reply:
    tokens: list[int]
    final: router_pb2.GenerateResponse | None
    error: grpc.StatusCode | None = None


async def _generate(stack: VllmStack, prompt: list[int], max_tokens: int = NUM_GENERATED,
                    timeout_s: float = 120.0) -> Reply:
    tokens: list[int] = []
    final = None
    target, options = channel_target(stack.stack.router_addresses[0])
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        request = router_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=prompt, prefill_mode=pb.PREFILL_MODE_REMOTE,
            sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        try:
            async for message in stub.Generate(request, timeout=timeout_s):
                tokens.extend(message.token_ids)
                final = message
        except grpc.aio.AioRpcError as exc:
            return Reply(tokens, final, exc.code())
    return Reply(tokens, final)


async def _wait_for(predicate: Callable[[], Awaitable[bool]], timeout_s: float = 30.0,
                    what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if await predicate():
            return
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.2)


def _engine_pids(process: ServiceProcess) -> set[int]:
    return process.descendants()


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


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
    decode_before = await vllm_stack.status("decode")
    prefill_id = vllm_stack.worker("prefill").worker_id
    decode_id = vllm_stack.worker("decode").worker_id
    replies = dict(zip(PROMPTS, await asyncio.gather(
        *(_generate(vllm_stack, prompt) for prompt in PROMPTS.values())), strict=True))
    replies.update({name: await _generate(vllm_stack, prompt)
                    for name, prompt in AFTER_SEED.items()})

    for name, reply in replies.items():
        assert reply.error is None, (name, reply.error)
        assert reply.tokens == vllm_stack.reference[name], name
        assert len(reply.tokens) == NUM_GENERATED, name
        assert reply.final is not None
        assert reply.final.prefill_worker_id == prefill_id, name
        assert reply.final.decode_worker_id == decode_id, name
        assert not reply.final.timing.is_local_prefill, name

    # Every block's checksum on the decode side equals its source's on the prefill side.
    decode = await vllm_stack.status("decode")
    prefill = await vllm_stack.status("prefill")
    seen = {(c.token.ticket_id, c.token.attempt) for c in decode_before.kv_checksums}
    landed = [c for c in decode.kv_checksums if (c.token.ticket_id, c.token.attempt) not in seen]
    sent = {(c.token.ticket_id, c.token.attempt): c for c in prefill.kv_checksums}
    assert len(landed) == len(replies)
    expected_blocks = sorted(
        math.ceil(len(p) / BLOCK_SIZE) - (2 if name == "decode_has_prefix" else 0)
        for name, p in {**PROMPTS, **AFTER_SEED}.items())
    assert sorted(c.num_blocks for c in landed) == expected_blocks
    for checksum in landed:
        source = sent[(checksum.token.ticket_id, checksum.token.attempt)]
        assert list(checksum.block_crc32s) == list(source.block_crc32s)
        assert len(checksum.block_crc32s) == checksum.num_blocks
        assert checksum.crc32 == source.crc32

    # vLLM's own accounting on the decode engine: every prompt token it did not compute came
    # from the transfer (a whole-prompt load still recomputes the last token to sample from,
    # which vLLM counts as transferred; a one-token prompt it recomputes and counts as computed).
    before, after = decode_before.prompt_tokens_by_source, decode.prompt_tokens_by_source
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    prompts = [*PROMPTS.values(), *AFTER_SEED.values()]
    local_hit = 2 * BLOCK_SIZE
    assert delta.get("local_cache_hit", 0) == local_hit
    assert delta["external_kv_transfer"] == sum(len(p) for p in prompts if len(p) > 1) - local_hit
    assert delta.get("local_compute", 0) == sum(1 for p in prompts if len(p) == 1)


async def test_heartbeats_carry_vllms_load(vllm_stack: VllmStack) -> None:
    task = asyncio.create_task(_generate(vllm_stack, _prompt(60, 20), max_tokens=420,
                                         timeout_s=300))
    busy: list[pb.WorkerLoad] = []

    async def running() -> bool:
        load = vllm_stack.worker("decode").load
        if load.num_running_seqs >= 1:
            busy.append(load)
        return bool(busy) or task.done()

    await _wait_for(running, 60.0, "a heartbeat showing the running sequence")
    reply = await task
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
