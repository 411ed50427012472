"""Worker agents in one process over the in-process transport: the decode side admits, the
prefill side computes and ships layer by layer, tokens come out, and every block comes back."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pdserve.common.errors import InvalidArgumentError, StaleTokenError
from pdserve.common.types import FencingToken, WorkerRole, WorkerState
from pdserve.worker.agent import AgentConfig, WorkerAgent
from pdserve.worker.engines.sim import SimConfig, SimEngine
from pdserve.worker.scheduler.agents import create_agent
from pdserve.worker.transports.registry import get_backend

SIM = SimConfig(speedup=1e4, max_num_blocks=256, num_kv_layers=4)


async def _pair(transport: str = "inproc") -> tuple[WorkerAgent, WorkerAgent]:
    backend = get_backend(transport)
    decode = create_agent(AgentConfig("d1", "m", WorkerRole.DECODE, transport=transport),
                          SimEngine(SIM), backend)
    prefill = create_agent(AgentConfig("p1", "m", WorkerRole.PREFILL, transport=transport),
                           SimEngine(SIM), backend)
    await decode.start()
    await prefill.start()
    decode.state = prefill.state = WorkerState.READY
    return decode, prefill


async def _collect(stream) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for chunk, _ in stream:
        tokens += chunk
    return tokens


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
async def test_disaggregated_equals_local_and_frees_every_block(transport: str) -> None:
    decode, prefill = await _pair(transport)
    try:
        prompt = list(range(1, 200))
        local = FencingToken.new()
        local_tokens = await _collect(decode.decode(
            local, prompt, 12, is_local_prefill=True,
            num_blocks=decode.engine.layout.num_blocks_for(211)))
        remote = FencingToken.new()
        destination = decode.admit(remote, len(prompt), decode.engine.layout.num_blocks_for(211))
        stream = decode.decode(remote, prompt, 12)
        (first, timing, _), tokens = await asyncio.gather(
            prefill.prefill(remote, prompt, destination, lease_s=5.0), _collect(stream))
        assert tokens == local_tokens and len(tokens) == 12
        assert tokens[0] == first
        assert timing.num_bytes == (4 * len(destination.block_ids)
                                    * decode.engine.layout.block_nbytes)
        # The KV that landed equals what the prefill side computed, block for block.
        for layer in range(4):
            got = decode.engine.kv_cache.layer_buffers[layer][list(destination.block_ids)]
            patterns = prefill.engine._block_patterns(prompt) ^ np.uint8(layer)
            assert np.array_equal(got, patterns)
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
        assert prefill.allocator.num_free_blocks == prefill.allocator.num_blocks
        assert decode.owners.num_owned_blocks == 0
    finally:
        await decode.close()
        await prefill.close()


async def test_dropped_ticket_frees_blocks_and_refuses_late_decode() -> None:
    decode, prefill = await _pair()
    try:
        token = FencingToken.new()
        decode.admit(token, 40, 4)
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks - 4
        assert decode.drop(token, "lease expired") == 4
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
        with pytest.raises(StaleTokenError):
            await _collect(decode.decode(token, list(range(40)), 3))
    finally:
        await decode.close()
        await prefill.close()


async def test_bad_admission_is_refused_and_takes_nothing() -> None:
    decode, prefill = await _pair()
    try:
        with pytest.raises(InvalidArgumentError):
            decode.admit(FencingToken.new(), 100, 2)  # 2 blocks cannot hold 100 tokens
        with pytest.raises(InvalidArgumentError):
            decode.admit(FencingToken.new(), 10, 10_000)
        with pytest.raises(InvalidArgumentError):
            prefill.admit(FencingToken.new(), 10, 2)  # wrong role
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
    finally:
        await decode.close()
        await prefill.close()


async def test_tokens_made_while_the_consumer_lags_come_in_one_chunk() -> None:
    """A reader slower than the engine gets what piled up as one chunk (one message on the
    wire), the same tokens in the same order as a reader that keeps up."""
    decode, _ = await _pair()
    try:
        prompt = list(range(1, 100))
        num_blocks = decode.engine.layout.num_blocks_for(len(prompt) + 12)
        eager = await _collect(decode.decode(FencingToken.new(), prompt, 12,
                                             is_local_prefill=True, num_blocks=num_blocks))
        chunks: list[list[int]] = []
        stream = decode.decode(FencingToken.new(), prompt, 12, is_local_prefill=True,
                               num_blocks=num_blocks)
        for _ in range(2):  # the first token, then the sequence is in the batch
            chunk, _ = await anext(stream)
            chunks.append(chunk)
        assert decode.load().num_running_seqs == 1
        # The reader lags: every remaining token is made before it reads again.
        for _ in range(1000):
            if decode.load().num_running_seqs == 0:
                break
            await asyncio.sleep(0.001)
        assert decode.load().num_running_seqs == 0
        async for chunk, _ in stream:
            chunks.append(chunk)
        assert [len(c) for c in chunks] == [1, 1, 10]
        assert [t for c in chunks for t in c] == eager and len(eager) == 12
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
    finally:
        await decode.close()
