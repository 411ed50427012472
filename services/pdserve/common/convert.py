"""Conversions between the v1 protos and the core value types, in one place.

Servicers call these at the gRPC boundary; cores never see proto objects. Times leave the
coordinator as durations (``lease_remaining_ms``) so that no worker compares its clock with ours.
"""

from __future__ import annotations

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2 as kv_pb
from pdserve.common.errors import InvalidArgumentError
from pdserve.common.types import (
    FencingToken,
    LedgerSnapshot,
    Ticket,
    TicketState,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)

_ROLE_TO_PB: dict[WorkerRole, pb.WorkerRole] = {
    WorkerRole.PREFILL: pb.WORKER_ROLE_PREFILL,
    WorkerRole.DECODE: pb.WORKER_ROLE_DECODE,
}
_ROLE_FROM_PB: dict[int, WorkerRole] = {value: key for key, value in _ROLE_TO_PB.items()}
_STATE_TO_PB: dict[WorkerState, pb.WorkerState] = {
    WorkerState.REGISTERING: pb.WORKER_STATE_REGISTERING,
    WorkerState.LOADING: pb.WORKER_STATE_LOADING,
    WorkerState.READY: pb.WORKER_STATE_READY,
    WorkerState.DRAINING: pb.WORKER_STATE_DRAINING,
    WorkerState.DRAINED: pb.WORKER_STATE_DRAINED,
    WorkerState.FAILED: pb.WORKER_STATE_FAILED,
}
_STATE_FROM_PB: dict[int, WorkerState] = {value: key for key, value in _STATE_TO_PB.items()}
_TICKET_TO_PB: dict[TicketState, pb.TicketState] = {
    TicketState.OPEN: pb.TICKET_STATE_OPEN,
    TicketState.PREFILLING: pb.TICKET_STATE_PREFILLING,
    TicketState.TRANSFERRING: pb.TICKET_STATE_TRANSFERRING,
    TicketState.DONE: pb.TICKET_STATE_DONE,
    TicketState.ABORTED: pb.TICKET_STATE_ABORTED,
    TicketState.EXPIRED: pb.TICKET_STATE_EXPIRED,
}
_TICKET_FROM_PB: dict[int, TicketState] = {value: key for key, value in _TICKET_TO_PB.items()}


def role_to_pb(role: WorkerRole) -> pb.WorkerRole:
    return _ROLE_TO_PB[role]


def role_from_pb(
    value: int, *, field: str = "role", allow_unspecified: bool = False
) -> WorkerRole | None:
    if value == pb.WORKER_ROLE_UNSPECIFIED and allow_unspecified:
        return None
    try:
        return _ROLE_FROM_PB[value]
    except KeyError:
        raise InvalidArgumentError(f"{field}: expected PREFILL or DECODE", field=field) from None


def worker_state_to_pb(state: WorkerState) -> pb.WorkerState:
    return _STATE_TO_PB[state]


def worker_state_from_pb(value: int, *, field: str = "state") -> WorkerState:
    try:
        return _STATE_FROM_PB[value]
    except KeyError:
        raise InvalidArgumentError(f"{field}: unknown worker state {value}", field=field) from None


def ticket_state_to_pb(state: TicketState) -> pb.TicketState:
    return _TICKET_TO_PB[state]


def ticket_state_from_pb(
    value: int, *, field: str = "state", allow_unspecified: bool = False
) -> TicketState | None:
    if value == pb.TICKET_STATE_UNSPECIFIED and allow_unspecified:
        return None
    try:
        return _TICKET_FROM_PB[value]
    except KeyError:
        raise InvalidArgumentError(f"{field}: unknown ticket state {value}", field=field) from None


def token_to_pb(token: FencingToken) -> pb.FencingToken:
    return pb.FencingToken(ticket_id=token.ticket_id, attempt=token.attempt)


def token_from_pb(message: pb.FencingToken, *, field: str = "token") -> FencingToken:
    if not message.ticket_id:
        raise InvalidArgumentError(f"{field}.ticket_id: required", field=f"{field}.ticket_id")
    if message.attempt < 1:
        raise InvalidArgumentError(f"{field}.attempt: must be >= 1", field=f"{field}.attempt")
    return FencingToken(ticket_id=message.ticket_id, attempt=message.attempt)


def load_to_pb(load: WorkerLoad) -> pb.WorkerLoad:
    return pb.WorkerLoad(
        num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        num_running_seqs=load.num_running_seqs,
        num_free_blocks=load.num_free_blocks,
        num_total_blocks=load.num_total_blocks,
        num_waiting_seqs=load.num_waiting_seqs,
    )


def load_from_pb(message: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        num_queued_prefill_tokens=message.num_queued_prefill_tokens,
        num_running_seqs=message.num_running_seqs,
        num_free_blocks=message.num_free_blocks,
        num_total_blocks=message.num_total_blocks,
        num_waiting_seqs=message.num_waiting_seqs,
    )


def ticket_to_pb(ticket: Ticket, now_s: float) -> kv_pb.Ticket:
    remaining_ms = 0 if ticket.is_held or ticket.state.is_terminal else max(
        0, int((ticket.lease_deadline_s - now_s) * 1000)
    )
    return kv_pb.Ticket(
        token=token_to_pb(ticket.token),
        state=ticket_state_to_pb(ticket.state),
        deployment=ticket.deployment,
        decode_worker_id=ticket.decode_worker_id,
        prefill_worker_id=ticket.prefill_worker_id,
        num_blocks=ticket.num_blocks,
        is_held=ticket.is_held,
        lease_remaining_ms=remaining_ms,
        request_id=ticket.request_id,
        num_prompt_tokens=ticket.num_prompt_tokens,
        reason=ticket.reason,
        created_unix_ms=int(ticket.created_s * 1000),
    )


def ledger_to_pb(snapshot: LedgerSnapshot) -> kv_pb.LedgerEntry:
    return kv_pb.LedgerEntry(
        decode_worker_id=snapshot.worker_id,
        num_total_blocks=snapshot.num_total_blocks,
        num_reserved_blocks=snapshot.num_reserved_blocks,
        num_held_blocks=snapshot.num_held_blocks,
        num_free_blocks=snapshot.num_free_blocks,
    )


def worker_to_pb(worker: WorkerRecord, extra: pb.WorkerInfo | None = None) -> pb.WorkerInfo:
    """``extra`` carries static fields (engine, layout, ...) the record does not keep."""
    message = pb.WorkerInfo()
    if extra is not None:
        message.CopyFrom(extra)
    message.worker_id = worker.worker_id
    message.deployment = worker.deployment
    message.role = role_to_pb(worker.role)
    message.state = worker_state_to_pb(worker.state)
    message.address = worker.address
    message.kv_address = worker.kv_address
    message.load.CopyFrom(load_to_pb(worker.load))
    message.last_heartbeat_unix_ms = int(worker.last_heartbeat_s * 1000)
    return message
