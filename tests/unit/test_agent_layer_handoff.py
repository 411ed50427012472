"""The agent's side of the layer handoff: finished layers cross from the engine thread to the
event loop in batches, layers found finished together are offered together, and the decode
side's checksum of the landed KV is kept however its stream ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest

from pdserve.common.types import FencingToken, WorkerRole, WorkerState
from pdserve.worker.agent import AgentConfig, WorkerAgent
from pdserve.worker.engine import Sequence as EngineSequence
from pdserve.worker.engines.sim import SimConfig, SimEngine
from pdserve.worker.kv_checksums import kv_checksum
from pdserve.worker.scheduler.agents import create_agent
from pdserve.worker.scheduler.prefill import _ReadyLayers
from pdserve.worker.transports.registry import get_backend

SIM = SimConfig(speedup=1e4, max_num_blocks=256, num_kv_layers=6)


async def test_ready_layers_arrive_in_order_and_in_batches() -> None:
    ready = _ReadyLayers(asyncio.get_running_loop())
    items: list[int | BaseException | None] = [*range(50), None]

    def produce() -> None:
        for item in items:
            ready.put(item)

    thread = threading.Thread(target=produce)
    thread.start()
    taken: list[int | BaseException | None] = []
    batches = 0
    while not taken or taken[-1] is not None:
        taken += await ready.take_all()
        batches += 1
    thread.join()
    assert taken == items
    assert batches <= len(items)

    for item in (7, 8, None):  # put before anyone waits: one batch
        ready.put(item)
    assert await ready.take_all() == [7, 8, None]


class _GatedSim(SimEngine):
    """Holds prefill before its first layer until ``go`` is set, and says when every layer has
    been handed over (``finished``), so a test can make them all pile up."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.started, self.go, self.finished = (threading.Event(), threading.Event(),
                                                threading.Event())

    def prefill_layers(self, seq: EngineSequence) -> Iterator[int]:
        self.started.set()
        self.go.wait(10)
        yield from super().prefill_layers(seq)
        self.finished.set()  # the agent has put the last layer for the loop by now


class _CountingBackend:
    """The inproc backend, recording how many layers each ``offer_layers`` call carried."""

    def __init__(self) -> None:
        self._inner = get_backend("inproc")
        self.name, self.is_pull = self._inner.name, self._inner.is_pull
        self.frame_versions = self._inner.frame_versions
        self.batches: list[int] = []

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def create_receiver(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.create_receiver(*args, **kwargs)

    def create_sender(self, *args: Any, **kwargs: Any) -> Any:
        sender = self._inner.create_sender(*args, **kwargs)
        inner_offer_layers = sender.offer_layers

        async def offer_layers(layers: Sequence[int], *rest: Any) -> None:
            self.batches.append(len(layers))
            await inner_offer_layers(layers, *rest)

        sender.offer_layers = offer_layers
        return sender


async def _pair(backend: Any, prefill_engine: SimEngine | None = None
                ) -> tuple[WorkerAgent, WorkerAgent]:
    decode = create_agent(AgentConfig("d1", "m", WorkerRole.DECODE, transport=backend.name),
                          SimEngine(SIM), backend)
    prefill = create_agent(AgentConfig("p1", "m", WorkerRole.PREFILL, transport=backend.name),
                           prefill_engine or SimEngine(SIM), backend)
    await decode.start()
    await prefill.start()
    decode.state = prefill.state = WorkerState.READY
    return decode, prefill


async def test_layers_finished_together_are_offered_together() -> None:
    backend = _CountingBackend()
    engine = _GatedSim(SIM)
    decode, prefill = await _pair(backend, engine)
    try:
        prompt = list(range(1, 100))
        token = FencingToken.new()
        destination = decode.admit(token, len(prompt), decode.engine.layout.num_blocks_for(101))
        stream = decode.decode(token, prompt, 2)
        first = asyncio.ensure_future(anext(stream))
        job = asyncio.ensure_future(prefill.prefill(token, prompt, destination, lease_s=5.0))
        while not engine.started.is_set():
            await asyncio.sleep(0.001)
        engine.go.set()
        assert engine.finished.wait(10)  # blocks the loop while the thread finishes every layer
        await job
        assert (await first)[0]
        await stream.aclose()
        assert backend.batches == [SIM.num_kv_layers]
    finally:
        engine.go.set()
        await prefill.close()
        await decode.close()


@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_decode_keeps_the_landed_kv_checksum_however_the_stream_ends(
        max_tokens: int) -> None:
    decode, prefill = await _pair(get_backend("tcp"))
    try:
        for stop_after_first in (False, True):
            prompt = list(range(3, 90))
            token = FencingToken.new()
            num_blocks = decode.engine.layout.num_blocks_for(len(prompt) + max_tokens)
            destination = decode.admit(token, len(prompt), num_blocks)
            stream = decode.decode(token, prompt, max_tokens)
            job = asyncio.ensure_future(prefill.prefill(token, prompt, destination, lease_s=5.0))
            if stop_after_first:
                await anext(stream)
                await stream.aclose()  # the client went away after the first token
            else:
                assert len([t async for chunk, _ in stream for t in chunk]) == max_tokens
            await job
            sent = [c for c in prefill.kv_checksums if c.token == token]
            landed = [c for c in decode.kv_checksums if c.token == token]
            assert len(sent) == len(landed) == 1
            assert landed[0].crc32 == sent[0].crc32
            assert landed[0].num_blocks == len(destination.block_ids)
        assert decode.allocator.num_free_blocks == decode.allocator.num_blocks
    finally:
        await prefill.close()
        await decode.close()


def test_kv_checksum_is_over_every_layer_of_the_blocks_in_order() -> None:
    engine = SimEngine(SIM)
    rng = np.random.default_rng(4)
    for buffer in engine.kv_cache.layer_buffers:
        buffer[:] = rng.integers(0, 256, buffer.shape, dtype=np.uint8)
    base = kv_checksum(engine.kv_cache, [5, 2])
    assert kv_checksum(engine.kv_cache, [2, 5]) != base
    engine.kv_cache.layer_buffers[-1][2, 0] ^= 1
    assert kv_checksum(engine.kv_cache, [5, 2]) != base
