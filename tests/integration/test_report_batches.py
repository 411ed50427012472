"""DONE reports and releases in batches (``KvTransferService.ReportTickets``): a real coordinator
behind a real gRPC server, on the memory backend and on real Redis, and the worker's
``GrpcControlPlane`` that batches what it reports while a call is on the wire.

Each report in a batch is applied and answered as its own call would be; one ticket's reports
in order; a coordinator without the RPC gets one call per report.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from pdserve.api.v1 import kv_transfer_pb2 as kv_pb
from pdserve.api.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.common.clock import ManualClock
from pdserve.common.convert import ticket_state_to_pb, token_to_pb
from pdserve.common.errors import PdserveError
from pdserve.common.grpc_client import Backoff
from pdserve.common.grpc_server import GrpcServer
from pdserve.common.settings import CommonSettings
from pdserve.common.types import (
    MAX_TICKET_REPORTS,
    FencingToken,
    TicketSpec,
    TicketState,
    WorkerLoad,
    WorkerRole,
    WorkerState,
)
from pdserve.kv_transfer.app import CoordinatorApp
from pdserve.kv_transfer.coordinator import CoordinatorPolicy
from pdserve.kv_transfer.rendezvous import MemoryRendezvous
from pdserve.pool.manager import Heartbeat, PoolManager, PoolPolicy, Registration
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.prefix_index import MemoryPrefixIndex
from pdserve.worker.control import GrpcControlPlane, ReportBatcher

MODEL = "m-batches"
NUM_BLOCKS = 400


class Coordinator:
    """A coordinator on a gRPC server of its own, with one decode and one prefill worker."""

    def __init__(self, url: str | None) -> None:
        self.clock = ManualClock(1000.0)
        self.backend = open_backend(url, self.clock,
                                    StateOptions(key_prefix=f"pdt-{uuid.uuid4().hex[:10]}"))
        self.app = CoordinatorApp(self.backend, self.clock, CoordinatorPolicy(),
                                  MemoryRendezvous(), CommonSettings())
        self.server = GrpcServer()
        self.app.register(self.server)
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> grpc.aio.Channel:
        decode = PoolManager(PoolPolicy(WorkerRole.DECODE, "t"), self.backend,
                             MemoryPrefixIndex(), self.clock)
        prefill = PoolManager(PoolPolicy(WorkerRole.PREFILL, "t"), self.backend,
                              MemoryPrefixIndex(), self.clock)
        await decode.register(Registration("d-1", MODEL, "a:1", num_total_blocks=NUM_BLOCKS), "t")
        await decode.heartbeat(Heartbeat(
            "d-1", WorkerState.READY, WorkerLoad(num_free_blocks=NUM_BLOCKS,
                                                 num_total_blocks=NUM_BLOCKS), {}))
        await prefill.register(Registration("p-1", MODEL, "a:2"), "t")
        await prefill.heartbeat(Heartbeat("p-1", WorkerState.READY, WorkerLoad()))
        port = await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        return self.channel

    async def open(self) -> FencingToken:
        ticket = await self.app.coordinator.open_ticket(TicketSpec(MODEL, "d-1", "p-1", 4, 30.0))
        return ticket.token

    async def state(self, token: FencingToken) -> TicketState:
        ticket = await self.app.coordinator.get(token.ticket_id)
        assert ticket is not None
        return ticket.state

    async def num_free_blocks(self) -> int:
        [snapshot] = await self.app.coordinator.ledgers("d-1")
        return snapshot.num_free_blocks

    async def close(self, url: str | None) -> None:
        if self.channel is not None:
            await self.channel.close()
        await self.server.stop(0)
        if url is not None:
            client = self.backend.client  # type: ignore[attr-defined]
            keys = [k async for k in client.scan_iter(match=f"{self.backend.keys.prefix}:*")]  # type: ignore[attr-defined]
            if keys:
                await client.delete(*keys)
        await self.backend.close()


@pytest.fixture(params=["memory", "redis"])
async def coordinator(request: pytest.FixtureRequest) -> AsyncIterator[Coordinator]:
    url = None if request.param == "memory" else request.getfixturevalue("redis_url")
    coordinator = Coordinator(url)
    yield coordinator
    await coordinator.close(url)


def _done(token: FencingToken) -> kv_pb.TicketReport:
    return kv_pb.TicketReport(progress=kv_pb.UpdateProgressRequest(
        token=token_to_pb(token), state=ticket_state_to_pb(TicketState.DONE),
        reporter_id="d-1"))


def _release(token: FencingToken) -> kv_pb.TicketReport:
    return kv_pb.TicketReport(release=kv_pb.ReleaseTicketRequest(token=token_to_pb(token)))


async def test_reports_of_many_tickets_go_out_in_few_calls(coordinator: Coordinator) -> None:
    plane = GrpcControlPlane(await coordinator.start(), "d-1")
    tokens = [await coordinator.open() for _ in range(40)]
    assert await coordinator.num_free_blocks() == NUM_BLOCKS - 40 * 4

    async def serve(token: FencingToken) -> None:  # as a decode worker's stream reports
        await plane.report(token, TicketState.DONE, None)
        await plane.release(token)

    await asyncio.gather(*(serve(token) for token in tokens))
    assert [await coordinator.state(token) for token in tokens] == [TicketState.DONE] * 40
    assert await coordinator.num_free_blocks() == NUM_BLOCKS
    assert plane.batcher is not None
    # Each call carries what was reported while the one before was on the wire: the 40 DONE
    # reports together, then the 40 releases, not 80 calls.
    assert plane.batcher.num_calls <= 4
    await plane.close()


async def test_each_report_answers_for_itself(coordinator: Coordinator) -> None:
    stub = kv_grpc.KvTransferServiceStub(await coordinator.start())
    good = await coordinator.open()
    stale = FencingToken(good.ticket_id, good.attempt + 1)
    response = await stub.ReportTickets(kv_pb.ReportTicketsRequest(reports=[
        _done(good), _done(stale), kv_pb.TicketReport(), _release(good)]))
    codes = [result.code for result in response.results]
    assert codes[0] == 0 and codes[3] == 0  # DONE, then its release, in order
    assert codes[2] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "reports[2]" in response.results[2].message
    # The stale token's report fails as its own UpdateProgress call does.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.UpdateProgress(_done(stale).progress)
    assert codes[1] == caught.value.code().value[0] != 0
    assert response.results[1].message == caught.value.details()
    assert await coordinator.state(good) is TicketState.DONE
    assert await coordinator.num_free_blocks() == NUM_BLOCKS


async def test_too_many_reports_are_refused_naming_the_field(coordinator: Coordinator) -> None:
    stub = kv_grpc.KvTransferServiceStub(await coordinator.start())
    token = await coordinator.open()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ReportTickets(kv_pb.ReportTicketsRequest(
            reports=[_done(token)] * (MAX_TICKET_REPORTS + 1)))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "reports" in (caught.value.details() or "")
    assert await coordinator.state(token) is TicketState.OPEN  # nothing applied


class _OldCoordinator(kv_grpc.KvTransferServiceServicer):
    """A coordinator of an earlier release: UpdateProgress and ReleaseTicket, no batches."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def UpdateProgress(self, request: Any, context: Any) -> kv_pb.UpdateProgressResponse:
        self.calls.append("UpdateProgress")
        return kv_pb.UpdateProgressResponse()

    async def ReleaseTicket(self, request: Any, context: Any) -> kv_pb.ReleaseTicketResponse:
        self.calls.append("ReleaseTicket")
        return kv_pb.ReleaseTicketResponse()


async def test_a_coordinator_without_batches_gets_one_call_per_report() -> None:
    server = grpc.aio.server()
    old = _OldCoordinator()
    kv_grpc.add_KvTransferServiceServicer_to_server(old, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            plane = GrpcControlPlane(channel, "d-1")
            tokens = [FencingToken(f"t-{i}", 1) for i in range(3)]
            await asyncio.gather(*(plane.report(t, TicketState.DONE, None) for t in tokens))
            await plane.release(tokens[0])
            assert plane.batcher is not None and not plane.batcher.is_supported
            assert sorted(old.calls) == ["ReleaseTicket"] + ["UpdateProgress"] * 3
            await plane.close()
    finally:
        await server.stop(0)


class _FlakyStub:
    """ReportTickets that fails the first calls (the whole call, or one report's result)."""

    def __init__(self, failures: list[str]) -> None:
        self._failures = failures
        self.batches: list[list[str]] = []

    async def ReportTickets(self, request: kv_pb.ReportTicketsRequest,
                            timeout: float) -> kv_pb.ReportTicketsResponse:
        ids = [getattr(r, r.WhichOneof("report")).token.ticket_id for r in request.reports]
        self.batches.append(ids)
        failure = self._failures.pop(0) if self._failures else ""
        if failure == "call":
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="test: store restarting")
        results = [kv_pb.TicketReportResult() for _ in ids]
        if failure == "first":  # the first report's store call timed out; the rest applied
            results[0].code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        if failure == "refuse":
            results[0].code = grpc.StatusCode.FAILED_PRECONDITION.value[0]
            results[0].message = "test: illegal transition"
        return kv_pb.ReportTicketsResponse(results=results)


async def _submit(batcher: ReportBatcher, *ticket_ids: str) -> list[BaseException | None]:
    reports = [_release(FencingToken(ticket_id, 1)) for ticket_id in ticket_ids]
    return await asyncio.gather(*(batcher.submit(r) for r in reports), return_exceptions=True)


async def test_failed_reports_go_out_again_before_newer_ones() -> None:
    stub = _FlakyStub(["call", "first"])
    batcher = ReportBatcher(stub, 1.0, backoff=Backoff(base_s=0.0, max_s=0.0))  # type: ignore[arg-type]
    outcomes = await _submit(batcher, "a", "b", "c")
    assert outcomes == [None, None, None]
    # The failed call's reports again, then only the report that timed out.
    assert stub.batches == [["a", "b", "c"], ["a", "b", "c"], ["a"]]
    await batcher.close()


async def test_a_refused_report_fails_its_submitter_only_and_is_not_repeated() -> None:
    stub = _FlakyStub(["refuse"])
    batcher = ReportBatcher(stub, 1.0)  # type: ignore[arg-type]
    refused, applied = await _submit(batcher, "a", "b")
    assert isinstance(refused, PdserveError)
    assert refused.code is grpc.StatusCode.FAILED_PRECONDITION
    assert "illegal transition" in refused.message
    assert applied is None
    assert stub.batches == [["a", "b"]]
    await batcher.close()


async def test_reports_are_repeated_only_until_their_deadline() -> None:
    clock = ManualClock(0.0)
    stub = _FlakyStub(["call"] * 100)
    batcher = ReportBatcher(stub, 1.0, clock=clock,  # type: ignore[arg-type]
                            backoff=Backoff(base_s=0.0, max_s=0.0))
    submitted = asyncio.ensure_future(_submit(batcher, "a"))
    while len(stub.batches) < 3:
        await asyncio.sleep(0)
    clock.advance(31.0)  # past REPORT_DEADLINE_S
    [outcome] = await submitted
    assert isinstance(outcome, PdserveError)
    assert outcome.code is grpc.StatusCode.UNAVAILABLE
    await batcher.close()
