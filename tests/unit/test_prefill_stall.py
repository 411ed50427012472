"""A prefill loop that stops advancing stops renewing its queue's leases.

Renewal runs on the heartbeat's cadence, on its own task: without a watermark, a hung prompt
loop would keep every ticket queued behind it alive forever. The scheduler stamps a progress
watermark whenever its loop advances (a prompt taken, layers computed or sent, a prompt done);
the agent renews queued leases only while the loop has advanced within ``max_prefill_stall_s``.
The clock is injected; the loop is held as a hung engine would hold it (``hold``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

from pdserve.common.types import FencingToken, TicketState, WorkerRole, WorkerState
from pdserve.worker.agent import AgentConfig
from pdserve.worker.engine import Sequence
from pdserve.worker.engines.sim import SimConfig, SimEngine
from pdserve.worker.runtime import TransferTiming
from pdserve.worker.scheduler.agents import ScheduledPrefillAgent, create_agent
from pdserve.worker.scheduler.prefill import PrefillScheduler
from pdserve.worker.transports.registry import get_backend

SIM = SimConfig(speedup=1e4, max_num_blocks=256, num_kv_layers=4)
STALL_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class RecordingControl:
    def __init__(self) -> None:
        self.renewed: list[FencingToken] = []

    async def report(self, token: FencingToken, state: TicketState,
                     timing: TransferTiming | None) -> None:
        return None

    async def renew(self, token: FencingToken, lease_s: float) -> None:
        self.renewed.append(token)

    async def release(self, token: FencingToken) -> None:
        return None


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _renewed_now(agent: ScheduledPrefillAgent, control: RecordingControl) -> set[str]:
    control.renewed.clear()
    await agent.renew_queued_leases()
    await _settle()
    return {str(token) for token in control.renewed}


async def test_a_held_loop_stops_renewing_its_queue_and_renews_again_once_it_advances() -> None:
    backend = get_backend("inproc")
    clock, control = Clock(), RecordingControl()
    decode = create_agent(AgentConfig("d1", "m", WorkerRole.DECODE, transport="inproc"),
                          SimEngine(SIM), backend)
    runtime = PrefillScheduler(SimEngine(SIM), clock=clock)
    prefill = ScheduledPrefillAgent(
        AgentConfig("p1", "m", WorkerRole.PREFILL, transport="inproc",
                    max_prefill_stall_s=STALL_S), runtime, backend, control)
    await decode.start()
    await prefill.start()
    decode.state = prefill.state = WorkerState.READY
    prompt = list(range(1, 100))
    num_blocks = decode.engine.layout.num_blocks_for(len(prompt) + 4)
    tokens = [FencingToken.new() for _ in range(2)]
    try:
        assert runtime.progress_stall_s() == 0.0  # idle is not stalled
        runtime.hold()
        jobs = []
        for token in tokens:
            destination = decode.admit(token, len(prompt), num_blocks)
            jobs.append(asyncio.ensure_future(asyncio.gather(
                prefill.prefill(token, prompt, destination, lease_s=2.0),
                _drain(decode.decode(token, prompt, 4)))))
        await _settle()
        assert [phase for _, _, phase in prefill.tickets()] == ["queued", "queued"]
        clock.now_s += 1.0
        assert runtime.progress_stall_s() == 1.0
        assert await _renewed_now(prefill, control) == {str(t) for t in tokens}
        clock.now_s += STALL_S  # the loop has not advanced for longer than the bound
        assert await _renewed_now(prefill, control) == set()
        assert await _renewed_now(prefill, control) == set()  # and stays silent
        runtime.release()
        await _settle()  # the loop takes the first prompt: it advanced now
        assert runtime.progress_stall_s() < STALL_S
        assert await _renewed_now(prefill, control) <= {str(t) for t in tokens}
        results = await asyncio.wait_for(asyncio.gather(*jobs), 30)
        assert [len(generated) for _, generated in results] == [4, 4]
        assert runtime.progress_stall_s() == 0.0
    finally:
        runtime.release()
        await decode.close()
        await prefill.close()


async def test_a_prompt_stuck_mid_transfer_stops_the_renewal_of_those_behind_it() -> None:
    backend = get_backend("inproc")
    clock, control = Clock(), RecordingControl()
    decode = create_agent(AgentConfig("d1", "m", WorkerRole.DECODE, transport="inproc"),
                          SimEngine(SIM), backend)
    engine = HangingEngine(SIM)
    runtime = PrefillScheduler(engine, clock=clock)
    prefill = ScheduledPrefillAgent(
        AgentConfig("p1", "m", WorkerRole.PREFILL, transport="inproc",
                    max_prefill_stall_s=STALL_S), runtime, backend, control)
    await decode.start()
    await prefill.start()
    decode.state = prefill.state = WorkerState.READY
    prompt = list(range(1, 100))
    num_blocks = decode.engine.layout.num_blocks_for(len(prompt) + 4)
    first, second = FencingToken.new(), FencingToken.new()
    try:
        # The first prompt starts computing and its engine hangs before the first layer.
        destination = decode.admit(first, len(prompt), num_blocks)
        running = asyncio.ensure_future(prefill.prefill(first, prompt, destination, lease_s=2.0))
        await asyncio.to_thread(engine.is_computing.wait, 30)
        destination = decode.admit(second, len(prompt), num_blocks)
        queued = asyncio.ensure_future(prefill.prefill(second, prompt, destination, lease_s=2.0))
        await _settle()
        phases = {str(t): phase for t, _, phase in prefill.tickets()}
        assert phases[str(second)] == "queued" and phases[str(first)] != "queued"
        assert await _renewed_now(prefill, control) == {str(second)}
        clock.now_s += STALL_S + 0.5
        assert runtime.progress_stall_s() > STALL_S
        assert await _renewed_now(prefill, control) == set()
        # The coordinator expires both tickets and tells the worker: both end, nothing hangs.
        prefill.drop(first, "lease expired")
        prefill.drop(second, "lease expired")
        decode.drop(first, "lease expired")
        decode.drop(second, "lease expired")
        engine.gate.set()
        for job in (running, queued):
            outcome = (await asyncio.wait_for(asyncio.gather(job, return_exceptions=True), 30))[0]
            assert isinstance(outcome, Exception), outcome
        await _settle()
        assert not prefill.tickets() and runtime.progress_stall_s() == 0.0
        assert prefill.allocator.num_free_blocks == prefill.allocator.num_blocks
    finally:
        engine.gate.set()
        await decode.close()
        await prefill.close()


class HangingEngine(SimEngine):
    """A sim engine whose prefill hangs before its first layer until ``gate`` is set."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.gate = threading.Event()
        self.is_computing = threading.Event()

    def prefill_layers(self, sequence: Sequence) -> Iterator[int]:
        self.is_computing.set()
        self.gate.wait(30)
        yield from super().prefill_layers(sequence)


async def _drain(stream) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for chunk, _ in stream:
        tokens += chunk
    return tokens
