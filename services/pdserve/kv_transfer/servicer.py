"""gRPC adapter of the KV-transfer coordinator: protos in, core calls, protos out. No policy."""

from __future__ import annotations

import asyncio
import functools
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
from pdserve.common.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from pdserve.common.types import FencingToken, Ticket, TicketSpec, TicketState, TransferRecord
from pdserve.kv_transfer.coordinator import KvTransferCoordinator
from pdserve.kv_transfer.rendezvous import Rendezvous

SERVICE_NAME = "pdserve.api.v1.KvTransferService"


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
        token = token_from_pb(request.token)
        await self._check_party(token, "UpdateProgress")
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
        token = token_from_pb(request.token)
        await self._check_party(token, "ReleaseTicket")
        ticket, _ = await asyncio.gather(self._core.release(token),
                                         self._rendezvous.forget(token))
        return kv_pb.ReleaseTicketResponse(ticket=ticket_to_pb(ticket, self._now()))

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

