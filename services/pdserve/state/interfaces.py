"""Narrow interfaces over hot state. Services use these, never raw Redis commands.

Two backends implement every interface and pass one contract suite
(``tests/integration/test_state_contract.py``): ``redis`` (shared, multi-replica) and ``memory``
(embedded, one process). Errors are ``pdserve.common.errors`` types:

- ``InvalidArgumentError``: unknown worker, block count <= 0 or above the worker's total,
  non-positive lease; nothing is reserved.
- ``CapacityError``: the worker has too few free blocks right now; nothing is reserved.
- ``StaleTokenError``: the token's ticket is unknown (expired and reaped, or lost in a store
  restart) or its attempt is not the current one.
- ``IllegalTransitionError``: the ticket state machine refuses the move.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.common.tokenizer_bundle import TokenizerBundle
from pdserve.common.types import (
    BlockReport,
    DecodeWorkerView,
    FencingToken,
    LedgerSnapshot,
    PoolEvent,
    PoolEvents,
    PoolSnapshot,
    PublishedThreshold,
    ReconcileResult,
    ThresholdSource,
    Ticket,
    TicketSpec,
    TicketState,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)


class WorkerStore(Protocol):
    """Worker records with a heartbeat TTL. A record whose TTL lapses disappears (the pool
    manager's health loop marks it FAILED first, from ``last_heartbeat_s``)."""

    async def upsert(self, worker: WorkerRecord, ttl_s: float) -> None: ...

    async def heartbeat(self, worker_id: str, load: WorkerLoad, ttl_s: float) -> WorkerRecord:
        """Refresh TTL and load; raises ``NotFoundError`` if the record is gone (re-register)."""
        ...

    async def set_state(self, worker_id: str, state: WorkerState) -> WorkerRecord: ...

    async def get(self, worker_id: str) -> WorkerRecord | None: ...

    async def list(
        self, deployment: str | None = None, role: WorkerRole | None = None
    ) -> list[WorkerRecord]: ...

    async def remove(self, worker_id: str) -> None: ...


class TicketLedger(Protocol):
    """Tickets and the per-decode-worker block ledger they reserve from.

    Opening a ticket creates it and reserves its blocks in one atomic step. A ticket's blocks
    are *reserved* from ``open`` until ``mark_held`` (DONE only; the running sequence now owns
    them) or until they are freed by ``release``, an ABORTED/EXPIRED transition, the reaper,
    ``drop_worker`` or ``reconcile``. Reserved blocks always have a lease; a lapsed lease
    (deadline < now) no longer entitles its token to ``extend``, ``mark_held`` or a non-freeing
    ``transition`` (``StaleTokenError``), and the reaper frees it: a non-terminal ticket becomes
    EXPIRED, a DONE ticket never marked held keeps DONE with reason "lease expired before
    mark_held". Held blocks are freed only by ``release`` (or ``drop_worker``/``reconcile``).
    ``release`` of a non-terminal ticket aborts it. Blocks are freed at most once: once free,
    ``release``/``extend``/``mark_held`` are ``StaleTokenError``. A ticket whose blocks are free
    stays readable for ``StateOptions.ticket_retention_s``.
    """

    async def set_capacity(
        self, worker_id: str, num_total_blocks: int, view: DecodeWorkerView | None = None
    ) -> LedgerSnapshot:
        """Create or resize a decode worker's ledger (registration / heartbeat), and keep
        ``view`` of the worker beside it when given."""
        ...

    async def describe_worker(self, worker_id: str, view: DecodeWorkerView) -> None:
        """Keep ``view`` beside the worker's ledger (a state change); nothing without a ledger."""
        ...

    async def drop_worker(self, worker_id: str) -> list[Ticket]:
        """Forget a worker's ledger; returns its non-terminal tickets, now ABORTED."""
        ...

    async def open(self, spec: TicketSpec, *, should_check_worker: bool = False) -> Ticket:
        """Create the ticket and reserve its blocks. With ``should_check_worker``, the decode
        worker is checked against the view kept beside its ledger in the same step: another
        deployment is ``InvalidArgumentError`` (field ``decode_worker_id``), not READY or its
        record expired ``UnavailableError``, no view ``WorkerUnverifiedError``."""
        ...

    async def get(self, token: FencingToken) -> Ticket:
        """The ticket; ``StaleTokenError`` if unknown or another attempt."""
        ...

    async def find(self, ticket_id: str) -> Ticket | None:
        """The ticket by id whatever its attempt, or None."""
        ...

    async def transition(
        self, token: FencingToken, state: TicketState, reason: str = ""
    ) -> Ticket:
        """Move the ticket. Terminal ABORTED/EXPIRED free its reserved (not held) blocks."""
        ...

    async def extend(self, token: FencingToken, lease_s: float) -> Ticket:
        """Push the lease deadline to now + ``lease_s``."""
        ...

    async def mark_held(self, token: FencingToken) -> Ticket:
        """Reserved -> held (no lease from now on). Ticket must be DONE."""
        ...

    async def hold_done(self, token: FencingToken) -> tuple[Ticket, bool]:
        """``transition`` to DONE unless the ticket is DONE already, then ``mark_held``, in one
        step (the same errors); returns the ticket and whether this call held its blocks (False
        for a repeated DONE)."""
        ...

    async def release(self, token: FencingToken) -> Ticket:
        """Free the ticket's blocks (held or reserved). A second release is ``StaleTokenError``."""
        ...

    async def reap_expired(self, worker_id: str | None = None) -> list[Ticket]:
        """Expire every lapsed lease (of one worker, or all); returns the tickets expired."""
        ...

    async def snapshot(self, worker_id: str) -> LedgerSnapshot: ...

    async def list_tickets(
        self, worker_id: str | None = None, state: TicketState | None = None
    ) -> list[Ticket]: ...

    async def reconcile(self, report: BlockReport) -> ReconcileResult:
        """Make the ledger agree with what the worker says it holds (see ``ReconcileResult``)."""
        ...


class PoolEventStream(Protocol):
    """The change stream routers follow, with a snapshot to resync from after a gap."""

    async def publish(self, event: PoolEvent) -> str:
        """Append; returns the new cursor. ``event.cursor`` is ignored."""
        ...

    async def read(self, deployment: str, cursor: str, timeout_s: float = 0.0) -> PoolEvents:
        """Events after ``cursor``; waits up to ``timeout_s`` for the first one."""
        ...

    async def snapshot(self, deployment: str, workers: WorkerStore) -> PoolSnapshot: ...


class TargetStore(Protocol):
    """Target pool sizes set by hand or by the governor."""

    async def set_target(self, deployment: str, role: WorkerRole, num_workers: int) -> None: ...

    async def get_target(self, deployment: str, role: WorkerRole) -> int | None: ...


class ThresholdStore(Protocol):
    """The local-prefill threshold the governor publishes per deployment, which routers read
    (all at once, on a short interval: never per request). Soft state like the rest: the
    governor publishes again on its next pass after a store loss (a pin from its durable copy).
    """

    async def publish(self, deployment: str, threshold_tokens: int,
                      source: ThresholdSource) -> PublishedThreshold:
        """Put ``threshold_tokens`` in force for ``deployment``, with the next version."""
        ...

    async def clear(self, deployment: str) -> None:
        """No threshold in force (routers fall back to their setting); the version count stays."""
        ...

    async def get(self, deployment: str) -> PublishedThreshold | None: ...

    async def list(self) -> dict[str, PublishedThreshold]:
        """Every deployment's threshold in force, by deployment (one read)."""
        ...


class TokenizerStore(Protocol):
    """Model tokenizers by digest (``TokenizerBundle.sha256``), with a TTL. Soft state like the
    rest: the pool manager extends a bundle's TTL with every heartbeat of a worker that serves
    it, and asks that worker to send it again when the store has lost it."""

    async def put(self, bundle: TokenizerBundle, ttl_s: float) -> None:
        """Store (or replace) the bundle under its digest, live for ``ttl_s``."""
        ...

    async def get(self, sha256: str) -> TokenizerBundle | None:
        """The live bundle with this digest, or None."""
        ...

    async def touch(self, sha256: str, ttl_s: float) -> bool:
        """Extend a live bundle's TTL to ``ttl_s`` from now; False if there is none."""
        ...


class StateBackend(Protocol):
    """One backend: the stores it provides and its lifecycle."""

    @property
    def workers(self) -> WorkerStore: ...

    @property
    def tickets(self) -> TicketLedger: ...

    @property
    def events(self) -> PoolEventStream: ...

    @property
    def targets(self) -> TargetStore: ...

    @property
    def tokenizers(self) -> TokenizerStore: ...

    @property
    def thresholds(self) -> ThresholdStore: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...
