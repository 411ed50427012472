"""The whole stack on vLLM (``stack_support``) with the KV over nixl and two prefill workers: the
decode engine's connector READs each layer a prefill engine's connector announces, out of that
engine's registered KV cache into blocks the decode side owns. The same token-exact, checksummed
handoff as over tcp (``test_stack``; the fault tests there exercise the paths both transports
share); prefix routing fed by vLLM's own KV cache events: a conversation's second turn goes
to the prefill worker whose engine holds the first turn, and stops being sent there for its
prefix once that engine has evicted it; and a stream whose decode worker is killed after its
first tokens going on, token for token, on another decode worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from e2e.conftest import ServiceProcess
from e2e.faults import MODEL, list_workers, ready_counts, wait_router_sees
from helpers.requirements import require_nixl
from stack_support import (
    AFTER_SEED,
    BLOCK_SIZE,
    PROMPTS,
    WORKER_START_S,
    VllmStack,
    _generate,
    _prompt,
    _wait_for,
    check_token_exact_and_checksummed,
    start_vllm_stack,
    status_of,
)

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, router_pb2, router_pb2_grpc
from pdserve.common.grpc_client import channel_target
from pdserve.common.tokenizer import prefix_block_hashes
from pdserve.state.prefix_index import RedisPrefixIndex

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

TURN_ONE = _prompt(8 * BLOCK_SIZE + 10, 30)
"""A first turn of eight full blocks (and a partial one, which no engine caches)."""
MAX_FILLERS = 96
_LIVE = (pb.TICKET_STATE_OPEN, pb.TICKET_STATE_PREFILLING, pb.TICKET_STATE_TRANSFERRING)
FAILOVER_TOKENS = 192
"""Long enough that vLLM is still decoding after several paused outputs: it decodes on during
each pause and what it made comes with the next output, so with 64 tokens a fast engine (a
quiet machine) finished in two or three outputs and the kill after the third missed."""
KILL_AFTER_OUTPUTS = (1, 3)
OUTPUT_PAUSE_S = 0.1
"""Before each decode output is handed on: the client kills within milliseconds of its k-th
output, long before the next one leaves (what vLLM made meanwhile dies with the worker)."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nixl_stack(tiny_model_dir: Path, e2e_redis_url: str, e2e_database_url: str,
                     processes: list[ServiceProcess]) -> AsyncIterator[VllmStack]:
    require_nixl()
    yield await start_vllm_stack(tiny_model_dir, e2e_redis_url, e2e_database_url, processes,
                                 transport="nixl", prompts={**PROMPTS, **AFTER_SEED},
                                 num_prefill=2)


async def test_workers_register_nixl(nixl_stack: VllmStack) -> None:
    for role in ("prefill", "decode"):
        for worker in nixl_stack.workers(role):
            assert "nixl" in worker.kv_transports, role


async def test_handoff_over_nixl_is_token_exact_and_checksummed(nixl_stack: VllmStack) -> None:
    await check_token_exact_and_checksummed(nixl_stack)


async def _cache_hits(stack: VllmStack, worker_id: str) -> int:
    (worker,) = [w for w in stack.workers("prefill") if w.worker_id == worker_id]
    return (await status_of(worker)).prompt_tokens_by_source.get("local_cache_hit", 0)


async def test_second_turn_goes_where_vllm_holds_the_first_until_it_is_evicted(
        nixl_stack: VllmStack) -> None:
    client = aioredis.Redis.from_url(nixl_stack.stack.env["PDSERVE_REDIS_URL"])
    index = RedisPrefixIndex(client)
    worker_ids = [w.worker_id for w in nixl_stack.workers("prefill")]
    hashes = prefix_block_hashes(TURN_ONE, BLOCK_SIZE)
    assert len(hashes) == 8

    async def held() -> dict[str, int]:
        return await index.overlap(MODEL, worker_ids, hashes)

    try:
        first = await _generate(nixl_stack, TURN_ONE)
        assert first.error is None and first.final is not None
        holder = first.final.prefill_worker_id
        (other,) = set(worker_ids) - {holder}

        async def indexed() -> bool:  # the engine's events, reported on a heartbeat
            return (await held())[holder] == len(hashes)

        await _wait_for(indexed, 30.0, "the first turn's blocks in the holder's prefix index")
        assert (await held())[other] == 0

        # The second turn extends the first: it goes to the holder, whose vLLM finds the first
        # turn's eight full blocks in its prefix cache (vLLM's own count for the request,
        # ``RequestOutput.num_cached_tokens``, which the usage reports as OpenAI's
        # ``cached_tokens``).
        assert first.final.usage.cached_prompt_tokens == 0
        turn_two = TURN_ONE + first.tokens + _prompt(40, 31)
        hits_before = await _cache_hits(nixl_stack, holder)
        second = await _generate(nixl_stack, turn_two)
        assert second.error is None and second.final is not None
        assert second.final.prefill_worker_id == holder
        assert second.final.usage.cached_prompt_tokens == len(hashes) * BLOCK_SIZE
        # vLLM's running counter (its stat loggers' prompt tokens by source), as the agent
        # reports it: printed only, it reaches the agent with the engine's next stats record.
        await asyncio.sleep(1.0)
        print(f"holder's prefix-cache hit counter for the second turn: "
              f"{await _cache_hits(nixl_stack, holder) - hits_before} tokens "
              f"(the first turn's full blocks: {len(hashes) * BLOCK_SIZE})")

        # Other conversations fill the holder's cache: vLLM evicts the first turn's blocks,
        # its events say so, and the index stops naming the holder for that prefix.
        num_fillers = 0

        async def evicted() -> bool:
            return (await held())[holder] == 0

        while not await evicted():
            assert num_fillers < MAX_FILLERS, "the holder's engine never evicted the first turn"
            batch = [_prompt(15 * BLOCK_SIZE, 100 + num_fillers + i) for i in range(4)]
            replies = await asyncio.gather(*(_generate(nixl_stack, p, max_tokens=1)
                                             for p in batch))
            assert all(r.error is None for r in replies)
            num_fillers += len(batch)
            await asyncio.sleep(1.0)  # a heartbeat carries the evictions
        hits = {w: await _cache_hits(nixl_stack, w) for w in worker_ids}
        third = await _generate(nixl_stack, turn_two)
        assert third.error is None and third.final is not None
        served_by = third.final.prefill_worker_id
        assert third.final.usage.cached_prompt_tokens == 0  # nothing was cached
        assert await _cache_hits(nixl_stack, served_by) == hits[served_by]
    finally:
        await client.aclose()


async def test_a_stream_whose_decode_worker_dies_goes_on_token_exact_on_another(
        nixl_stack: VllmStack, processes: list[ServiceProcess]) -> None:
    """kill -9 of the decode worker serving a stream (its vLLM engines with it, the process
    group) once the client has had k of its outputs, for each k in ``KILL_AFTER_OUTPUTS``: the
    router fails the stream over to another decode worker (prompt plus the delivered tokens
    prefilled again, over nixl) and the client's output equals the uninterrupted one, token for
    token (greedy, float32), one failover counted.

    The module's decode worker is replaced by ones that pause before handing on each output
    (``--test-decode-step-pause-s``): vLLM's decode of the tiny model on one thread outruns any
    client, so without the pause whether the kill lands before the stream's end would be timing
    luck; with it, the client acts on its k-th output long before the next is sent. One worker
    per kill, and one left to serve, started one at a time. Last in the module: it stops the
    module's decode worker first."""
    await asyncio.to_thread(nixl_stack.decode.stop)
    replacements = await asyncio.to_thread(
        _start_decode_workers, nixl_stack, processes, 1 + len(KILL_AFTER_OUTPUTS),
        ("--test-decode-step-pause-s", str(OUTPUT_PAUSE_S)))
    num_decode = len(replacements)
    for num_outputs in KILL_AFTER_OUTPUTS:
        await asyncio.to_thread(wait_router_sees, nixl_stack.stack.routers[0], 2, num_decode,
                                WORKER_START_S)
        await _check_failover_after(nixl_stack, replacements, num_outputs)
        num_decode -= 1


def _start_decode_workers(stack: VllmStack, processes: list[ServiceProcess], count: int,
                          extra_args: tuple[str, ...]) -> list[ServiceProcess]:
    """``count`` decode workers, started one at a time: each is READY in the router's view
    before the next starts (engines loading side by side on two cores slowed each other past
    ``WORKER_START_S`` once in CI, which said only that one never became ready). Fails at once,
    with the worker's own output, if it exits or its engine turns FAILED."""
    decode_pool = stack.stack.pool_address("decode")
    router = stack.stack.routers[0]

    def failed_ids() -> set[str]:
        return {w.worker_id for w in list_workers(decode_pool)
                if w.role == pb.WORKER_ROLE_DECODE and w.state == pb.WORKER_STATE_FAILED}

    started: list[ServiceProcess] = []
    for i in range(count):
        failed_before = failed_ids()
        process = stack.stack.start_worker("decode", f"vllm-decode-{i + 2}",
                                           extra_args=extra_args)
        processes.append(process)
        started.append(process)
        deadline = time.monotonic() + WORKER_START_S
        while True:
            with contextlib.suppress(grpc.RpcError):
                if ready_counts(router.grpc_address) == (2, i + 1):
                    break
            assert process.returncode is None, f"exited while loading\n{process.describe()}"
            newly_failed = failed_ids() - failed_before
            assert not newly_failed, (f"{process.name} turned FAILED ({newly_failed})\n"
                                      f"{process.describe()}")
            assert time.monotonic() < deadline, (
                f"{process.name} not READY in the router's view within {WORKER_START_S:.0f}s "
                f"(it sees {ready_counts(router.grpc_address)})\n{process.describe()}")
            time.sleep(0.5)
    return started


async def _check_failover_after(stack: VllmStack, decode_processes: list[ServiceProcess],
                                num_outputs: int) -> None:
    prompt = _prompt(60, 40 + num_outputs)
    reference = await _generate(stack, prompt, max_tokens=FAILOVER_TOKENS)
    assert reference.error is None and len(reference.tokens) == FAILOVER_TOKENS

    # The serving ones: an earlier round's victim may still be listed, its tickets not yet gone.
    decode_ids = [w.worker_id for w in stack.workers("decode")
                  if w.state == pb.WORKER_STATE_READY]

    async def idle() -> bool:  # the reference's ticket released: the next one is the stream's
        return not await _in_flight(stack, decode_ids)

    await _wait_for(idle, 30.0, "no ticket in flight")
    target, options = channel_target(stack.stack.router_addresses[0])
    tokens: list[int] = []
    final = None
    victim_id = ""
    num_seen = 0
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        call = router_pb2_grpc.RouterServiceStub(channel).Generate(router_pb2.GenerateRequest(
            model=MODEL, prompt_token_ids=prompt, prefill_mode=pb.PREFILL_MODE_REMOTE,
            sampling=pb.SamplingParams(max_tokens=FAILOVER_TOKENS, ignore_eos=True)),
            timeout=120)
        serving = asyncio.create_task(_serving(stack, decode_ids))
        try:
            async for message in call:
                tokens.extend(message.token_ids)
                final = message
                num_seen += bool(message.token_ids)
                if not victim_id and num_seen == num_outputs:
                    victim_id = await serving
                    os.killpg(_process_of_worker(decode_processes, victim_id).pid,
                              signal.SIGKILL)
        finally:
            serving.cancel()
    assert victim_id and final is not None, f"the stream had fewer than {num_outputs} outputs"
    assert len(tokens) == FAILOVER_TOKENS
    assert final.timing.num_failovers == 1, "the stream ended before its worker was killed"
    assert final.decode_worker_id != victim_id
    assert tokens == reference.tokens, f"after the kill at output {num_outputs}"


async def _serving(stack: VllmStack, decode_ids: list[str], timeout_s: float = 30.0) -> str:
    """The decode worker a ticket of the one request in flight names (polled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        serving = await _in_flight(stack, decode_ids)
        if serving:
            (worker_id,) = serving
            return worker_id
        await asyncio.sleep(0.005)
    raise AssertionError("no decode worker is named by a live or held ticket")


async def _in_flight(stack: VllmStack, decode_ids: list[str]) -> set[str]:
    """Decode workers named by a live ticket or a DONE one whose blocks are held until its
    sequence ends (released tickets are neither)."""
    target, options = channel_target(stack.stack.coordinator_address)
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = kv_transfer_pb2_grpc.KvTransferServiceStub(channel)
        named = set()
        for worker_id in decode_ids:
            tickets = (await stub.ListTickets(kv_transfer_pb2.ListTicketsRequest(
                decode_worker_id=worker_id), timeout=5)).tickets
            if any(t.state in _LIVE or (t.state == pb.TICKET_STATE_DONE and t.is_held)
                   for t in tickets):
                named.add(worker_id)
        return named


def _process_of_worker(processes: list[ServiceProcess], worker_id: str) -> ServiceProcess:
    for process in processes:
        if worker_id in process.output:  # it logs its id at registration
            return process
    raise AssertionError(f"no process registered as {worker_id}")
