"""What both hot-state backends share: their tunables, block-holding states and reasons, change-
stream cursors, the order tickets are listed in, and the validation of what callers hand them.
Backends import this; the factory imports the backends; nothing here imports either."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.common.errors import ConfigError, InvalidArgumentError, UnavailableError
from pdserve.common.types import (
    BlockReport,
    DecodeWorkerView,
    FencingToken,
    Ticket,
    TicketSpec,
    TicketState,
    WorkerState,
)


@dataclass(frozen=True, slots=True)
class StateOptions:
    """Tunables shared by both backends.

    ``key_prefix`` is the first part of every Redis key (tests use a random one to isolate
    themselves on a shared Redis). ``ticket_retention_s``: how long a ticket whose blocks are free
    stays readable by ``get``/``find``/``list_tickets`` (coordinator-clock seconds).
    ``reconcile_grace_s``: a ticket younger than this is never released by ``reconcile`` just
    because the worker's report does not mention it yet (the report may predate the ticket).
    ``stream_max_len``: events kept per deployment's change stream (Redis trims approximately, in
    whole stream nodes, so it may keep up to ~100 more). ``ticket_index_ttl_s``: lifetime of the
    Redis id -> decode worker index of a live ticket (a held sequence older than this can no
    longer be released by token; reconciliation frees its blocks once the worker stops
    reporting it). ``replica_acks``: Redis only; every script (and the ticket open) is
    acknowledged only once this many replicas have it (``WAIT``), so a failover to one of them
    loses no acknowledged write; fewer acknowledgements within ``replica_ack_timeout_s`` make the
    call fail as unavailable (its outcome unknown). 0 = asynchronous replication.
    """

    key_prefix: str = "pdserve"
    ticket_retention_s: float = 600.0
    reconcile_grace_s: float = 30.0
    stream_max_len: int = 10_000
    ticket_index_ttl_s: float = 86_400.0
    replica_acks: int = 0
    replica_ack_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.key_prefix or any(c in self.key_prefix for c in "{}: \t\n"):
            raise ConfigError(
                f"key_prefix: non-empty, without braces, colons or spaces, got {self.key_prefix!r}"
            )
        for name in ("ticket_retention_s", "reconcile_grace_s", "ticket_index_ttl_s",
                     "replica_ack_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}: a finite number >= 0, got {value!r}")
        if self.stream_max_len < 1:
            raise ConfigError(f"stream_max_len: >= 1, got {self.stream_max_len}")
        if self.replica_acks < 0:
            raise ConfigError(f"replica_acks: >= 0, got {self.replica_acks}")


class WorkerUnverifiedError(Exception):
    """``TicketLedger.open``: the ledger holds no view of the decode worker (``DecodeWorkerView``:
    a pool manager of an earlier release, or none written yet), so the caller must check the
    worker's record itself and open again without ``should_check_worker``."""


def check_worker_view(view: DecodeWorkerView, spec: TicketSpec, now: float) -> None:
    """Raise unless a ticket of ``spec`` may go to the decode worker ``view`` describes (the
    checks ``TicketLedger.open`` makes; ``lua/open.lua`` makes the same)."""
    worker_id = spec.decode_worker_id
    if view.deployment != spec.deployment:
        raise InvalidArgumentError(
            f"decode_worker_id: {worker_id!r} serves {view.deployment!r}, not "
            f"{spec.deployment!r}", field="decode_worker_id")
    if view.expires_s <= now:
        raise UnavailableError(f"decode worker {worker_id} is not in the pool")
    if view.state is not WorkerState.READY:
        raise UnavailableError(f"decode worker {worker_id} is {view.state}")


class BlockHolding(enum.StrEnum):
    """Where a ticket's blocks are in the ledger: counted as reserved (under a lease), held by a
    running sequence (no lease), or free again (released, aborted, expired)."""

    RESERVED = "reserved"
    HELD = "held"
    FREE = "free"


FREEING_STATES = frozenset({TicketState.ABORTED, TicketState.EXPIRED})
"""Transitions into these free the ticket's reserved blocks."""

REASON_RELEASED = "released"
REASON_LEASE_EXPIRED = "lease expired"
REASON_LEASE_EXPIRED_DONE = "lease expired before mark_held"
REASON_WORKER_DROPPED = "decode worker dropped"
REASON_NOT_REPORTED = "not reported by decode worker"
REASON_ADOPTED = "adopted from worker report"


def format_cursor(epoch: str, seq: int) -> str:
    """A change-stream cursor: the stream's epoch (new after every store loss) and the sequence
    number of the last event read (0 = before the first event)."""
    return f"{epoch}:{seq}"


def parse_cursor(cursor: str) -> tuple[str, int] | None:
    """``(epoch, seq)``, or None for the empty cursor (never read: resync from a snapshot)."""
    if not cursor:
        return None
    epoch, sep, seq_text = cursor.rpartition(":")
    if not sep or not epoch or not seq_text.isdigit():
        raise InvalidArgumentError(f"cursor: expected 'epoch:seq', got {cursor!r}", field="cursor")
    return epoch, int(seq_text)


MAX_EVENTS_PER_READ = 1000
"""Most events one change-stream read returns (the reader asks again for the rest)."""


def ordered_tickets(tickets: Iterable[Ticket]) -> list[Ticket]:
    """Tickets oldest first (ties by id): the order every listing of both backends returns."""
    return sorted(tickets, key=lambda t: (t.created_s, t.token.ticket_id))


def check_required(value: str, name: str) -> None:
    """``InvalidArgumentError`` naming ``name`` when ``value`` is empty."""
    if not value:
        raise InvalidArgumentError(f"{name}: required", field=name)


def check_ttl(ttl_s: float, name: str = "ttl_s") -> None:
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and ttl_s > 0):
        raise InvalidArgumentError(f"{name}: a finite number > 0, got {ttl_s!r}", field=name)


def check_count(value: int, name: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(f"{name}: an integer >= {minimum}, got {value!r}", field=name)


def parse_report(report: BlockReport) -> dict[str, tuple[int, int]]:
    """``ticket_id -> (attempt, num_blocks)`` from a worker's report; ``InvalidArgumentError``
    for a malformed token, a non-positive count, a ticket named twice or more blocks than the
    worker has."""
    check_required(report.worker_id, "worker_id")
    check_count(report.num_total_blocks, "num_total_blocks", 0)
    reported: dict[str, tuple[int, int]] = {}
    for text, num_blocks in report.blocks_by_token.items():
        try:
            token = FencingToken.parse(text)
        except ValueError:
            token = FencingToken("", 0)
        if not token.ticket_id or token.attempt < 1:
            raise InvalidArgumentError(
                f"blocks_by_token: bad token {text!r}", field="blocks_by_token"
            )
        check_count(num_blocks, "blocks_by_token", 1)
        if token.ticket_id in reported:
            raise InvalidArgumentError(
                f"blocks_by_token: ticket {token.ticket_id} named twice", field="blocks_by_token"
            )
        reported[token.ticket_id] = (token.attempt, num_blocks)
    num_reported = sum(num_blocks for _, num_blocks in reported.values())
    if num_reported > report.num_total_blocks:
        raise InvalidArgumentError(
            f"blocks_by_token: {num_reported} blocks reported, worker has "
            f"{report.num_total_blocks}",
            field="blocks_by_token",
        )
    return reported
