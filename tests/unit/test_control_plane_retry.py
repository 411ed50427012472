"""A worker's DONE reports and releases, which only it can send, are repeated through a
state-store failover (UNAVAILABLE, or an attempt that timed out while the store stalled) for
``REPORT_DEADLINE_S``; a lease renewal is not repeated past its short deadline (a late one would
extend a lease its worker stopped renewing)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from grpc.aio import AioRpcError, Metadata

from pdserve.common.errors import PdserveError
from pdserve.common.types import FencingToken, TicketState
from pdserve.worker.control import GrpcControlPlane


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
