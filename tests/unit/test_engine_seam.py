"""The engine seam (``pdserve.worker.runtime``) without pdserve's scheduler: agents over runtimes
that schedule themselves, as a vLLM adapter does.

The decode runtime here picks its blocks only when it "schedules" (``admit`` returns no
placement), so the worker hands out no destination; the agent still reports DONE with the
runtime's timing at the first token, releases the ticket when the stream ends, and turns a drop
into the runtime's abort. The prefill runtime keeps a prompt queued until told to go, and the
agent renews the ticket's lease exactly while it is queued, then reports its progress.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import worker_pb2
from pdserve.common.convert import token_to_pb
from pdserve.common.errors import InvalidArgumentError, StaleTokenError
from pdserve.common.types import FencingToken, TicketState, WorkerLoad, WorkerRole, WorkerState
from pdserve.worker.agent import AgentConfig
from pdserve.worker.decode_agent import DecodeAgent
from pdserve.worker.engine import KvLayout
from pdserve.worker.experts import ExpertParallelEngine
from pdserve.worker.kv_checksums import KvChecksum
from pdserve.worker.prefill_agent import PrefillAgent
from pdserve.worker.runtime import (
    DecodeChunk,
    DecodeRequest,
    DecodeRuntime,
    KvIntake,
    KvPlacement,
    PrefillPhase,
    PrefillResult,
    PrefillRuntime,
    PrefillTicket,
    ProfilePoint,
    TransferTiming,
)
from pdserve.worker.servicer import WorkerAgentServicer
from pdserve.worker.transports.registry import TransportBackend, get_backend
from pdserve.worker.transports.values import KvDestinationSpec

LAYOUT = KvLayout(num_layers=2, num_blocks=64, block_size_tokens=16, block_nbytes=256)
TIMING = TransferTiming(num_bytes=4096, num_layers=2, num_blocks=4, transfer_s=0.01)
NO_CONTEXT: Any = None
"""The servicer reads nothing from its gRPC context."""


class _Runtime:
    """What both fake runtimes report: a fixed shape, no passes, no checksums, no experts."""

    layout = LAYOUT
    profile: Sequence[ProfilePoint] = ()
    kv_checksums: Sequence[KvChecksum] = ()
    expert_engine: ExpertParallelEngine | None = None

    def __init__(self) -> None:
        self.aborted: dict[FencingToken, str] = {}
        self.is_closed = False

    def load(self) -> WorkerLoad:
        return WorkerLoad(num_free_blocks=LAYOUT.num_blocks, num_total_blocks=LAYOUT.num_blocks)

    async def close(self) -> None:
        self.is_closed = True


class SelfSchedulingDecode(_Runtime):
    """Blocks are the engine's business: known only once a request is scheduled."""

    def __init__(self) -> None:
        super().__init__()
        self.admitted: dict[FencingToken, int] = {}
        self.streams: dict[FencingToken, asyncio.Queue[int | None]] = {}

    async def start(self, kv_host: str, kv_port: int, transport: TransportBackend) -> KvIntake:
        return KvIntake("engine-side:5555")

    def admit(self, token: FencingToken, num_prompt_tokens: int,
              num_blocks: int) -> KvPlacement | None:
        self.admitted[token] = num_blocks
        return None

    async def decode(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        tokens: asyncio.Queue[int | None] = asyncio.Queue()
        self.streams[request.token] = tokens
        try:
            yield DecodeChunk([100], TIMING)
            for _ in range(request.max_tokens - 1):
                new_token = await tokens.get()
                if new_token is None:
                    raise StaleTokenError(f"aborted: {self.aborted[request.token]}")
                yield DecodeChunk([new_token])
        finally:
            del self.streams[request.token]
            self.admitted.pop(request.token, None)

    def abort(self, token: FencingToken, reason: str) -> int:
        self.aborted[token] = reason
        if token in self.streams:
            self.streams[token].put_nowait(None)
        return self.admitted.get(token, 0)


class QueueingPrefill(_Runtime):
    """Holds each prompt QUEUED until ``go`` is set, then computes it at once."""

    takes_late_destinations: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.tickets: list[PrefillTicket] = []

    async def start(self, transport: TransportBackend) -> None:
        return None

    async def prefill(self, ticket: PrefillTicket) -> PrefillResult:
        self.tickets.append(ticket)
        await self.go.wait()
        ticket.phase = PrefillPhase.PREFILLING
        await asyncio.sleep(0.05)
        ticket.phase = PrefillPhase.SENDING
        await asyncio.sleep(0.05)
        return PrefillResult(7, TIMING, 0)

    def abort(self, token: FencingToken, reason: str) -> None:
        self.aborted[token] = reason

    def progress_stall_s(self) -> float:
        return 0.0

    def take_prefix_delta(self) -> tuple[list[int], list[int]]:
        return [1], []

    def all_prefix_hashes(self) -> list[int]:
        return [1, 2]


class RecordingControl:
    def __init__(self) -> None:
        self.calls: list[tuple[str, FencingToken, object]] = []

    async def report(self, token: FencingToken, state: TicketState,
                     timing: TransferTiming | None) -> None:
        self.calls.append(("report", token, (state, timing)))

    async def renew(self, token: FencingToken, lease_s: float) -> None:
        self.calls.append(("renew", token, lease_s))

    async def release(self, token: FencingToken) -> None:
        self.calls.append(("release", token, None))


async def _settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def _decode_agent() -> tuple[DecodeAgent, SelfSchedulingDecode, RecordingControl]:
    runtime, control = SelfSchedulingDecode(), RecordingControl()
    seam: DecodeRuntime = runtime
    agent = DecodeAgent(AgentConfig("d1", "m", WorkerRole.DECODE, transport="tcp"), seam,
                        get_backend("tcp"), control)
    return agent, runtime, control


async def test_a_decode_engine_that_picks_its_blocks_late_gets_no_destination() -> None:
    agent, runtime, control = _decode_agent()
    await agent.start()
    agent.state = WorkerState.READY
    servicer = WorkerAgentServicer(agent, pb.WorkerInfo)
    token = FencingToken.new()
    response = await servicer.AdmitTicket(worker_pb2.AdmitTicketRequest(
        token=token_to_pb(token), num_prompt_tokens=40, num_blocks=4, transport="tcp"),
        NO_CONTEXT)
    assert not response.HasField("destination")  # published through the rendezvous instead
    assert agent.kv_address == "engine-side:5555" and agent.receiver is None
    assert runtime.admitted == {token: 4}
    assert agent.held_blocks() == {str(token): 4}
    assert agent.tickets() == [(token, 4, "admitted")]

    tokens = [t async for chunk, _ in agent.decode(token, list(range(40)), 1) for t in chunk]
    await _settle()
    assert tokens == [100]
    assert control.calls == [("report", token, (TicketState.DONE, TIMING)),
                             ("release", token, None)]
    assert not agent.tickets() and not runtime.admitted
    await agent.close()
    assert runtime.is_closed


async def test_dropping_a_decoding_ticket_aborts_it_in_the_engine() -> None:
    agent, runtime, control = _decode_agent()
    await agent.start()
    agent.state = WorkerState.READY
    token = FencingToken.new()
    assert agent.admit(token, 40, 4) is None
    stream = agent.decode(token, list(range(40)), 5)
    first, timing = await anext(stream)
    assert (first, timing) == ([100], TIMING)
    assert agent.tickets() == [(token, 4, "decoding")]
    assert agent.drop(token, "lease expired") == 4
    assert runtime.aborted == {token: "lease expired"}
    assert agent.tickets(), "a decoding stream holds the ticket until it ends"
    with pytest.raises(StaleTokenError):
        await anext(stream)
    await _settle()
    assert not agent.tickets()
    assert [name for name, _, _ in control.calls] == ["report", "release"]
    await agent.close()


async def test_a_queued_prompt_has_its_lease_renewed_until_it_runs() -> None:
    runtime, control = QueueingPrefill(), RecordingControl()
    seam: PrefillRuntime = runtime
    agent = PrefillAgent(AgentConfig("p1", "m", WorkerRole.PREFILL, transport="tcp"), seam,
                         get_backend("tcp"), control)
    await agent.start()
    agent.state = WorkerState.READY
    token = FencingToken.new()
    destination = KvDestinationSpec("engine-side:5555", (1, 2, 3), "tcp", LAYOUT)
    job = asyncio.ensure_future(agent.prefill(token, list(range(40)), destination, lease_s=2.5))
    await _settle()
    assert agent.tickets() == [(token, 0, "queued")]
    await agent.renew_queued_leases()
    await agent.renew_queued_leases()
    await _settle()
    assert control.calls == [("renew", token, 2.5), ("renew", token, 2.5)]
    runtime.go.set()
    while agent.tickets()[0][2] == "queued":
        await asyncio.sleep(0.005)
    await agent.renew_queued_leases()
    await agent.renew_queued_leases()  # progress is reported once per state
    result = await job
    await _settle()
    assert result == PrefillResult(7, TIMING, 0)
    assert [(name, arg) for name, _, arg in control.calls[2:]] == [
        ("report", (TicketState.PREFILLING, None))]
    assert agent.take_prefix_delta() == ([1], []) and agent.all_prefix_hashes() == [1, 2]
    assert not agent.tickets()
    await agent.close()


async def test_each_agent_refuses_the_other_roles_calls() -> None:
    decode, _, _ = _decode_agent()
    prefill = PrefillAgent(AgentConfig("p1", "m", WorkerRole.PREFILL), QueueingPrefill(),
                           get_backend("tcp"))
    destination = KvDestinationSpec("x:1", (1,), "tcp", LAYOUT)
    with pytest.raises(InvalidArgumentError, match="p1 is a prefill worker"):
        prefill.admit(FencingToken.new(), 10, 2)
    with pytest.raises(InvalidArgumentError, match="p1 is a prefill worker"):
        await anext(prefill.decode(FencingToken.new(), [1, 2], 3))
    with pytest.raises(InvalidArgumentError, match="d1 is a decode worker"):
        await decode.prefill(FencingToken.new(), [1, 2], destination, lease_s=1.0)
    with pytest.raises(InvalidArgumentError, match="cannot serve as a decode worker"):
        PrefillAgent(AgentConfig("d2", "m", WorkerRole.DECODE), QueueingPrefill(),
                     get_backend("tcp"))


async def test_a_prefill_without_destination_needs_a_runtime_that_takes_late_ones() -> None:
    """No destination = the decode engine publishes it at the rendezvous later (vLLM): a runtime
    that picks nothing up from there refuses such a ticket, naming the field; one that does gets
    the ticket with no destination and the agent leaves the block count to it."""
    runtime = QueueingPrefill()
    agent = PrefillAgent(AgentConfig("p1", "m", WorkerRole.PREFILL, transport="tcp"), runtime,
                         get_backend("tcp"))
    await agent.start()
    agent.state = WorkerState.READY
    with pytest.raises(InvalidArgumentError) as refused:
        await agent.prefill(FencingToken.new(), list(range(40)), None, lease_s=2.5)
    assert refused.value.field == "destination"
    runtime.takes_late_destinations = True
    runtime.go.set()
    token = FencingToken.new()
    result = await agent.prefill(token, list(range(40)), None, lease_s=2.5)
    assert result.first_token_id == 7
    assert runtime.tickets[-1].destination is None
    await agent.close()
