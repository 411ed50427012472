"""gRPC adapter of the KV-transfer coordinator: protos in, core calls, protos out. No policy."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2 as kv_pb
from pdserve.api.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.common.auth import count_refusal, current_principal
from pdserve.common.convert import (
    ledger_to_pb,
    ticket_state_from_pb,
    ticket_to_pb,
    token_from_pb,
)
from pdserve.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    status_for,
)
from pdserve.common.types import (
    MAX_TICKET_REPORTS,
    FencingToken,
    Ticket,
    TicketSpec,
    TicketState,
    TransferRecord,
)
from pdserve.kv_transfer.coordinator import KvTransferCoordinator
from pdserve.kv_transfer.rendezvous import Rendezvous

logger = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.api.v1.KvTransferService"
_REPEATED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""A report's errors after which its sender repeats it (and the same ticket's later ones)."""


def _transfer_record(stats: pb.TransferStats, ticket: Ticket) -> TransferRecord:
    """The statistics a worker reported with DONE, for the ticket as it is once held."""
    return TransferRecord(
        ticket=ticket, num_bytes=stats.num_bytes,
        prefill_compute_s=stats.prefill_compute_ms / 1000,
        transfer_s=stats.transfer_ms / 1000, exposed_s=stats.exposed_ms / 1000,
        outcome=TicketState.DONE,
    )


class KvTransferServicer(kv_grpc.KvTransferServiceServicer):
    def __init__(self, coordinator: KvTransferCoordinator, rendezvous: Rendezvous) -> None:
        self._core = coordinator
        self._rendezvous = rendezvous

    def _now(self) -> float:
        return self._core.clock()

    async def _check_party(self, token: FencingToken, method: str) -> None:
        """A caller with a worker credential acts only on tickets that name its worker (one
        read of the ticket; services and certificate holders are not bound)."""
        principal = current_principal()
        if principal is None or not principal.worker_id:
            return
        ticket = await self._core.get(token.ticket_id)
        if ticket is None:
            return  # the call itself says NOT_FOUND (or is an idempotent no-op)
        if principal.worker_id not in (ticket.prefill_worker_id, ticket.decode_worker_id):
            count_refusal(f"/{SERVICE_NAME}/{method}", grpc.StatusCode.PERMISSION_DENIED)
            raise PermissionDeniedError(
                f"token: ticket {token.ticket_id} does not name worker {principal.worker_id!r}",
                field="token")

    async def OpenTicket(
        self, request: kv_pb.OpenTicketRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.OpenTicketResponse:
        ticket = await self._core.open_ticket(TicketSpec(
            deployment=request.deployment,
            decode_worker_id=request.decode_worker_id,
            prefill_worker_id=request.prefill_worker_id,
            num_blocks=request.num_blocks,
            lease_s=self._core.lease_s(request.lease_ms),
            request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
        ))
        return kv_pb.OpenTicketResponse(ticket=ticket_to_pb(ticket, self._now()))

    async def UpdateProgress(
        self, request: kv_pb.UpdateProgressRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.UpdateProgressResponse:
        return await self._update_progress(request, "UpdateProgress")

    async def _update_progress(self, request: kv_pb.UpdateProgressRequest,
                               method: str) -> kv_pb.UpdateProgressResponse:
        token = token_from_pb(request.token)
        await self._check_party(token, method)
        state = ticket_state_from_pb(request.state)
        assert state is not None
        if state in (TicketState.ABORTED, TicketState.EXPIRED, TicketState.OPEN):
            raise InvalidArgumentError(
                "state: progress moves to PREFILLING, TRANSFERRING or DONE (use AbortTicket)",
                field="state")
        record_of = None
        if state is TicketState.DONE and request.HasField("stats"):
            record_of = functools.partial(_transfer_record, request.stats)
        ticket = await self._core.update_progress(token, state, record_of)
        response = kv_pb.UpdateProgressResponse(ticket=ticket_to_pb(ticket, self._now()))
        if request.HasField("stats"):
            response.ticket.stats.CopyFrom(request.stats)
        return response

    async def RenewLease(
        self, request: kv_pb.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.RenewLeaseResponse:
        token = token_from_pb(request.token)
        await self._check_party(token, "RenewLease")
        ticket = await self._core.renew(token, self._core.lease_s(request.lease_ms))
        return kv_pb.RenewLeaseResponse(ticket=ticket_to_pb(ticket, self._now()))

    async def PublishDestination(
        self, request: kv_pb.PublishDestinationRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.PublishDestinationResponse:
        token = token_from_pb(request.token)
        await self._check_party(token, "PublishDestination")
        ticket = await self._core.get(token.ticket_id)
        if ticket is None or ticket.token != token or ticket.state.is_terminal:
            raise NotFoundError(f"token: no open ticket {token}", field="token")
        await self._rendezvous.publish(token, request.destination.SerializeToString(),
                                       self._core.policy.max_lease_s)
        return kv_pb.PublishDestinationResponse()

    async def AwaitDestination(
        self, request: kv_pb.AwaitDestinationRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.AwaitDestinationResponse:
        token = token_from_pb(request.token)
        await self._check_party(token, "AwaitDestination")
        timeout_s = min(request.timeout_ms / 1000 if request.timeout_ms else 5.0, 60.0)
        payload = await self._rendezvous.wait(token, timeout_s)
        ticket = await self._core.get(token.ticket_id)
        response = kv_pb.AwaitDestinationResponse(is_ready=payload is not None)
        if payload is not None:
            response.destination.ParseFromString(payload)
        if ticket is not None:
            response.ticket.CopyFrom(ticket_to_pb(ticket, self._now()))
        return response

    async def AbortTicket(
        self, request: kv_pb.AbortTicketRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.AbortTicketResponse:
        token = token_from_pb(request.token)
        await self._check_party(token, "AbortTicket")
        ticket = await self._core.abort(
            token, request.reason or f"aborted by {request.reporter_id or 'client'}"
        )
        await self._rendezvous.forget(token)
        return kv_pb.AbortTicketResponse(ticket=ticket_to_pb(ticket, self._now()))

    async def ReleaseTicket(
        self, request: kv_pb.ReleaseTicketRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.ReleaseTicketResponse:
        return await self._release(request, "ReleaseTicket")

    async def _release(self, request: kv_pb.ReleaseTicketRequest,
                       method: str) -> kv_pb.ReleaseTicketResponse:
        token = token_from_pb(request.token)
        await self._check_party(token, method)
        ticket, _ = await asyncio.gather(self._core.release(token),
                                         self._rendezvous.forget(token))
        return kv_pb.ReleaseTicketResponse(ticket=ticket_to_pb(ticket, self._now()))

    async def ReportTickets(
        self, request: kv_pb.ReportTicketsRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.ReportTicketsResponse:
        """Each report as its own call (its checks, its errors); one ticket's in order, and
        none after one of them failed UNAVAILABLE or DEADLINE_EXCEEDED (the sender repeats
        them in order); different tickets' concurrently."""
        reports = request.reports
        if len(reports) > MAX_TICKET_REPORTS:
            raise InvalidArgumentError(
                f"reports: {len(reports)}, more than {MAX_TICKET_REPORTS} in one call",
                field="reports")
        results = [kv_pb.TicketReportResult() for _ in reports]
        by_ticket: dict[str, list[int]] = {}
        for index, report in enumerate(reports):
            kind = report.WhichOneof("report")
            if kind is None:
                results[index].code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
                results[index].message = f"reports[{index}]: neither progress nor release"
                continue
            ticket_id = getattr(report, kind).token.ticket_id
            by_ticket.setdefault(ticket_id, []).append(index)

        async def apply_in_order(indexes: list[int]) -> None:
            is_failed = False
            for index in indexes:
                result = results[index]
                if is_failed:
                    result.code = grpc.StatusCode.UNAVAILABLE.value[0]
                    result.message = "not applied: an earlier report of this ticket failed"
                    continue
                report = reports[index]
                try:
                    if report.HasField("progress"):
                        await self._update_progress(report.progress, "ReportTickets")
                    else:
                        await self._release(report.release, "ReportTickets")
                except Exception as exc:  # noqa: BLE001 - each report answers for itself
                    code, message = status_for(exc)
                    if code is grpc.StatusCode.INTERNAL:
                        logger.error("ReportTickets: a report failed: %s", type(exc).__name__,
                                     exc_info=exc)
                    result.code, result.message = code.value[0], message
                    is_failed = code in _REPEATED

        await asyncio.gather(*(apply_in_order(indexes) for indexes in by_ticket.values()))
        return kv_pb.ReportTicketsResponse(results=results)

    async def GetTicket(
        self, request: kv_pb.GetTicketRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.GetTicketResponse:
        if not request.ticket_id:
            raise InvalidArgumentError("ticket_id: required", field="ticket_id")
        ticket = await self._core.get(request.ticket_id)
        if ticket is None:
            raise NotFoundError(f"ticket_id: no ticket {request.ticket_id!r}", field="ticket_id")
        return kv_pb.GetTicketResponse(ticket=ticket_to_pb(ticket, self._now()))

    async def ListTickets(
        self, request: kv_pb.ListTicketsRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.ListTicketsResponse:
        state = ticket_state_from_pb(request.state, allow_unspecified=True)
        tickets = await self._core.list_tickets(request.decode_worker_id or None, state)
        limit = request.limit or 1000
        now = self._now()
        return kv_pb.ListTicketsResponse(tickets=[ticket_to_pb(t, now) for t in tickets[:limit]])

    async def WatchTickets(
        self, request: kv_pb.WatchTicketsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_pb.WatchTicketsResponse]:
        async for ticket in self._core.watch(request.worker_id):
            yield kv_pb.WatchTicketsResponse(ticket=ticket_to_pb(ticket, self._now()))

    async def GetLedger(
        self, request: kv_pb.GetLedgerRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb.GetLedgerResponse:
        snapshots = await self._core.ledgers(
            request.decode_worker_id or None, request.deployment or None
        )
        return kv_pb.GetLedgerResponse(entries=[ledger_to_pb(s) for s in snapshots])

