"""The worker's clients of the control plane: the coordinator (ticket progress, leases, release)
and its pool manager (registration and heartbeats). Workers speak gRPC only."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2 as kv_pb
from pdserve.api.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.api.v1 import pool_pb2, pool_pb2_grpc
from pdserve.common.convert import load_to_pb, ticket_state_to_pb, token_to_pb, worker_state_to_pb
from pdserve.common.errors import PdserveError, code_of_number, error_from_status
from pdserve.common.grpc_client import Backoff, call_with_retry, error_from_rpc_error
from pdserve.common.types import (
    MAX_TICKET_REPORTS,
    FencingToken,
    TicketState,
    WorkerLoad,
    WorkerState,
)
from pdserve.worker.runtime import TransferTiming

logger = logging.getLogger(__name__)

REPORT_DEADLINE_S = 30.0
"""How long a worker repeats a DONE report or a release that fails UNAVAILABLE or times out."""
REPORT_REPEATED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""The errors after which a DONE report or a release is sent again."""
REPORT_BACKOFF = Backoff(base_s=0.1, max_s=2.0)
"""Between repeats of a batch's DONE reports and releases."""
REGISTER_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.RESOURCE_EXHAUSTED)
"""Registration errors that say the pool manager cannot answer yet (it is starting, its store is
restarting or failing over), not that it refuses this worker."""


class _NotBatched(Exception):
    """The coordinator does not know ReportTickets (an older release): call one by one."""


@dataclass(slots=True, eq=False)
class _Queued:
    report: kv_pb.TicketReport
    done: asyncio.Future[None]
    deadline: float


class ReportBatcher:
    """DONE reports and releases of many tickets in few calls: what is submitted while a
    ``ReportTickets`` call is on the wire goes out together in the next one (one call at a
    time; at c16 a few reports a call, one at c1, so nothing waits for a batch to fill).

    A report answered UNAVAILABLE or DEADLINE_EXCEEDED (one report's, or the whole call's) goes
    out again, before newer ones, with backoff, until ``REPORT_DEADLINE_S`` after it was
    submitted, as a report sent on its own is repeated; any other error is its submitter's.
    Callers keep one ticket's reports in order by submitting the next after the last is done
    (``worker.reports.TicketReports``)."""

    def __init__(self, stub: kv_grpc.KvTransferServiceStub, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 backoff: Backoff = REPORT_BACKOFF) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._clock = clock
        self._backoff = backoff
        self._queue: deque[_Queued] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.is_supported = True
        """False once the coordinator answered UNIMPLEMENTED (callers fall back)."""
        self.num_calls = 0
        """ReportTickets calls made (reports per call: what was submitted over this)."""

    async def submit(self, report: kv_pb.TicketReport) -> None:
        """Once the report is applied; raises its error (a ``PdserveError``), or
        ``_NotBatched`` where the coordinator cannot take batches."""
        if not self.is_supported:
            raise _NotBatched
        queued = _Queued(report, asyncio.get_running_loop().create_future(),
                         self._clock() + REPORT_DEADLINE_S)
        self._queue.append(queued)
        self._wakeup.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send_loop(), name="report-batches")
        await queued.done

    async def close(self) -> None:
        """Stop sending; reports not yet answered are cancelled (the worker is going away)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while self._queue:
            self._queue.popleft().done.cancel()

    async def _send_loop(self) -> None:
        num_failures = 0
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = [self._queue.popleft()
                         for _ in range(min(len(self._queue), MAX_TICKET_REPORTS))]
                batch = [queued for queued in batch if not queued.done.done()]  # cancelled
                if not batch:
                    continue
                outcomes = await self._call(batch)
                if outcomes is None:
                    return
                repeated = [queued for queued, error in zip(batch, outcomes, strict=True)
                            if not self._settle(queued, error)]
                if not repeated:
                    num_failures = 0
                    continue
                self._queue.extendleft(reversed(repeated))  # before newer reports, in order
                await asyncio.sleep(self._backoff.delay_s(num_failures, random.random))
                num_failures += 1

    async def _call(self, batch: list[_Queued]) -> list[PdserveError | None] | None:
        """Each report's error (None: applied); None when the coordinator has no batches (each
        submitter was told, and what is still queued)."""
        request = kv_pb.ReportTicketsRequest(reports=[queued.report for queued in batch])
        self.num_calls += 1
        try:
            response = await self._stub.ReportTickets(request, timeout=self._timeout_s)
        except Exception as exc:  # noqa: BLE001 - whatever fails the call, each report learns
            error = (error_from_rpc_error(exc) if isinstance(exc, grpc.RpcError)
                     else exc if isinstance(exc, PdserveError)
                     else PdserveError(f"ReportTickets failed: {type(exc).__name__}: {exc}"))
            if error.code is grpc.StatusCode.UNIMPLEMENTED:
                self.is_supported = False
                for queued in [*batch, *self._queue]:
                    if not queued.done.done():
                        queued.done.set_exception(_NotBatched())
                self._queue.clear()
                return None
            return [error] * len(batch)
        return [None if result.code == 0 else
                error_from_status(code_of_number(result.code), result.message)
                for result in response.results]

    def _settle(self, queued: _Queued, error: PdserveError | None) -> bool:
        """Answer the submitter, or False: send the report again."""
        if queued.done.done():
            return True
        if error is None:
            queued.done.set_result(None)
            return True
        if error.code in REPORT_REPEATED and self._clock() < queued.deadline:
            return False
        queued.done.set_exception(error)
        return True


class GrpcControlPlane:
    """Implements ``pdserve.worker.reports.ControlPlane`` against the coordinator. DONE reports
    and releases go through a ``ReportBatcher`` (``is_batched``), one call each where the
    coordinator has no ``ReportTickets``."""

    def __init__(self, channel: grpc.aio.Channel, worker_id: str, timeout_s: float = 5.0,
                 *, is_batched: bool = True) -> None:
        self._stub = kv_grpc.KvTransferServiceStub(channel)
        self.worker_id = worker_id
        self._timeout_s = timeout_s
        self.batcher = ReportBatcher(self._stub, timeout_s) if is_batched else None

    async def close(self) -> None:
        if self.batcher is not None:
            await self.batcher.close()

    async def report(self, token: FencingToken, state: TicketState,
                     timing: TransferTiming | None) -> None:
        request = kv_pb.UpdateProgressRequest(token=token_to_pb(token),
                                              state=ticket_state_to_pb(state),
                                              reporter_id=self.worker_id)
        if timing is not None:
            request.stats.CopyFrom(timing.to_proto())
        if await self._batched(kv_pb.TicketReport(progress=request)):
            return
        await self._call_until_done(self._stub.UpdateProgress, request)

    async def _batched(self, report: kv_pb.TicketReport) -> bool:
        """Sent in a batch (True), or to be sent on its own (False)."""
        if self.batcher is None or not self.batcher.is_supported:
            return False
        try:
            await self.batcher.submit(report)
        except _NotBatched:
            return False
        return True

    async def renew(self, token: FencingToken, lease_s: float) -> None:
        await self._call(self._stub.RenewLease, kv_pb.RenewLeaseRequest(
            token=token_to_pb(token), lease_ms=int(lease_s * 1000)))

    async def release(self, token: FencingToken) -> None:
        request = kv_pb.ReleaseTicketRequest(token=token_to_pb(token))
        if await self._batched(kv_pb.TicketReport(release=request)):
            return
        await self._call_until_done(self._stub.ReleaseTicket, request)

    async def _call(self, method: Callable[..., Awaitable[object]], request: Message) -> None:
        """Progress reports, renewals and releases are idempotent at the coordinator, so a call
        that failed UNAVAILABLE (a coordinator replica died, its store restarted) is repeated,
        on whichever replica answers, within the deadline."""
        await self._repeat(method, request, self._timeout_s, retries=4, max_backoff_s=1.0)

    async def _call_until_done(self, method: Callable[..., Awaitable[object]],
                               request: Message) -> None:
        """A DONE or a release, which only this worker can send: one lost leaves the ledger
        holding the blocks until reconcile's grace has passed (``reconcile_grace_s``). So it is
        repeated for longer (``REPORT_DEADLINE_S``), also after an attempt that timed out: a
        state-store failover can stall one attempt past its deadline, and the next one then
        finds the new master. (Renewals keep the short deadline: a late one would extend a
        lease its worker no longer renews.)"""
        await self._repeat(method, request, REPORT_DEADLINE_S, retries=12, max_backoff_s=2.0,
                           retry_on=REPORT_REPEATED)

    async def _repeat(self, method: Callable[..., Awaitable[object]], request: Message,
                      deadline_s: float, *, retries: int, max_backoff_s: float,
                      retry_on: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,),
                      ) -> None:
        """``call_with_retry`` of one request, each attempt within the call timeout."""
        attempt_s = self._timeout_s
        await call_with_retry(
            lambda timeout_s: method(request, timeout=min(timeout_s, attempt_s)),
            deadline_s=deadline_s, retries=retries, retry_on=retry_on,
            backoff=Backoff(base_s=0.1, max_s=max_backoff_s))


class PoolClient:
    def __init__(self, channel: grpc.aio.Channel, join_token: str, timeout_s: float = 5.0) -> None:
        self._stub = pool_pb2_grpc.PoolServiceStub(channel)
        self._join_token = join_token
        self._timeout_s = timeout_s

    async def register(self, info: pb.WorkerInfo, expected_cold_start_s: float,
                       tokenizer: pb.TokenizerBundle | None = None, *,
                       deadline_s: float = 0.0) -> pool_pb2.RegisterResponse:
        """Join the pool. ``deadline_s`` > 0: a pool manager that cannot answer yet
        (``REGISTER_RETRIED``) is asked again, with backoff, until that many seconds have passed,
        as a worker started before its pool manager, or during a store restart, must; a refusal
        (join token, a bad field) fails at once. 0: one attempt."""
        request = pool_pb2.RegisterRequest(
            join_token=self._join_token, worker=info,
            expected_cold_start_s=expected_cold_start_s, tokenizer=tokenizer)

        async def attempt(timeout_s: float) -> pool_pb2.RegisterResponse:
            try:
                return await self._stub.Register(request, timeout=min(timeout_s, self._timeout_s))
            except grpc.RpcError as exc:
                error = error_from_rpc_error(exc)
                if deadline_s > 0 and error.code in REGISTER_RETRIED:
                    logger.warning("registration not answered (%s: %s); trying again",
                                   error.code.name, error.message)
                raise error from None

        if deadline_s <= 0:
            return await attempt(self._timeout_s)
        # A registration whose answer was lost leaves a LOADING record behind; it fails on
        # missed heartbeats as any silent worker does.
        return await call_with_retry(attempt, deadline_s=deadline_s, retries=10_000,
                                     retry_on=REGISTER_RETRIED,
                                     backoff=Backoff(base_s=0.2, max_s=2.0))

    async def heartbeat(self, info: pb.WorkerInfo, state: WorkerState, load: WorkerLoad,
                        held_blocks: dict[str, int], added: list[int], removed: list[int],
                        is_full: bool, expert_token_counts: list[int] | None = None,
                        num_moe_layers: int = 0,
                        tokenizer: pb.TokenizerBundle | None = None) -> pool_pb2.HeartbeatResponse:
        request = pool_pb2.HeartbeatRequest(
            worker_id=info.worker_id, state=worker_state_to_pb(state),
            load=load_to_pb(load),
            added_prefix_hashes=added, removed_prefix_hashes=removed,
            is_full_prefix_report=is_full, join_token=self._join_token, worker=info,
            expert_token_counts=expert_token_counts or [], num_moe_layers=num_moe_layers,
            tokenizer=tokenizer,
        )
        for key, num_blocks in held_blocks.items():
            token = FencingToken.parse(key)
            request.held_blocks.add(token=token_to_pb(token), num_blocks=num_blocks)
        try:
            return await self._stub.Heartbeat(request, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None

    async def deregister(self, worker_id: str) -> None:
        try:
            await self._stub.Deregister(pool_pb2.DeregisterRequest(
                worker_id=worker_id, join_token=self._join_token), timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from None
