"""A worker's DONE reports and releases, which only it can send, are repeated through a
state-store failover (UNAVAILABLE, or an attempt that timed out while the store stalled) for
``REPORT_DEADLINE_S``; a lease renewal is not repeated past its short deadline (a late one would
extend a lease its worker stopped renewing). A starting worker asks a pool manager that does not
answer yet again until its registration deadline; a refused join token fails at once."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata
from helpers.private_redis import free_port

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import pool_pb2, pool_pb2_grpc
from pdserve.common.errors import PdserveError
from pdserve.common.types import FencingToken, TicketState
from pdserve.worker.control import GrpcControlPlane, PoolClient


def _error(code: grpc.StatusCode) -> AioRpcError:
    return AioRpcError(code, Metadata(), Metadata(), details=f"test: {code.name}")


class _Method:
    """A stub method that fails with the given codes, then answers."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self._codes = list(codes)
        self.timeouts: list[float] = []

    async def __call__(self, request: Any, timeout: float) -> object:
        self.timeouts.append(timeout)
        if self._codes:
            raise _error(self._codes.pop(0))
        return object()


class _Stub:
    def __init__(self, method: _Method) -> None:
        self.UpdateProgress = self.ReleaseTicket = self.RenewLease = method


def _plane(method: _Method) -> GrpcControlPlane:
    plane = GrpcControlPlane.__new__(GrpcControlPlane)
    plane._stub = _Stub(method)  # type: ignore[assignment]
    plane.worker_id, plane._timeout_s = "d-1", 0.5
    plane.batcher = None  # one call per report (batches: tests/integration/test_report_batches)
    return plane


async def test_done_and_release_are_repeated_through_unavailable_and_timed_out_attempts() -> None:
    token = FencingToken("t", 1)
    codes = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.UNAVAILABLE)
    release = _Method(*codes)
    await _plane(release).release(token)
    assert len(release.timeouts) == 4
    assert all(t <= 0.5 for t in release.timeouts)  # each attempt within the call timeout
    done = _Method(*codes)
    await _plane(done).report(token, TicketState.DONE, None)
    assert len(done.timeouts) == 4


async def test_a_refused_release_and_a_timed_out_renewal_are_not_repeated() -> None:
    token = FencingToken("t", 1)
    stale = _Method(grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(PdserveError):
        await _plane(stale).release(token)
    assert len(stale.timeouts) == 1
    renew = _Method(grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(PdserveError):
        await _plane(renew).renew(token, 5.0)
    assert len(renew.timeouts) == 1


# -- registration -------------------------------------------------------------------------------


class _LatePool(pool_pb2_grpc.PoolServiceServicer):
    """A pool manager that refuses bad join tokens and registers everyone else."""

    def __init__(self) -> None:
        self.num_registered = 0

    async def Register(self, request: pool_pb2.RegisterRequest,
                       context: grpc.aio.ServicerContext) -> pool_pb2.RegisterResponse:
        if request.join_token != "good":
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "join_token: not valid")
        self.num_registered += 1
        return pool_pb2.RegisterResponse(worker_id="d-late", heartbeat_interval_ms=500)


async def test_a_worker_started_before_its_pool_manager_registers_once_it_listens() -> None:
    port = free_port()
    pool = _LatePool()
    server = grpc.aio.server()
    pool_pb2_grpc.add_PoolServiceServicer_to_server(pool, server)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = PoolClient(channel, "good", timeout_s=1.0)
        with pytest.raises(PdserveError) as refused:  # one attempt: nothing listens yet
            await client.register(pb.WorkerInfo(), 0.0)
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        registering = asyncio.create_task(client.register(pb.WorkerInfo(), 0.0, deadline_s=30.0))
        await asyncio.sleep(1.0)
        assert not registering.done()  # still asking
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            response = await asyncio.wait_for(registering, 30.0)
            assert response.worker_id == "d-late" and pool.num_registered == 1
            wrong = PoolClient(channel, "bad", timeout_s=1.0)
            with pytest.raises(PdserveError) as unauthenticated:  # a refusal is not retried
                await wrong.register(pb.WorkerInfo(), 0.0, deadline_s=30.0)
            assert unauthenticated.value.code is grpc.StatusCode.UNAUTHENTICATED
        finally:
            await server.stop(None)
