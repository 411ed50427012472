"""Value types of the hot (soft) state shared by control-plane services.

Everything here can be rebuilt from worker heartbeats after a store restart. Times are seconds on
the *coordinator's* clock (an injected ``Clock``), never a worker's.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

Clock = Callable[[], float]
"""Wall-clock seconds (``time.time`` in production). Injected so tests control time."""


class WorkerRole(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class WorkerState(enum.StrEnum):
    REGISTERING = "registering"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DRAINED = "drained"
    FAILED = "failed"


class TicketState(enum.StrEnum):
    OPEN = "open"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DONE = "done"
    ABORTED = "aborted"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({TicketState.DONE, TicketState.ABORTED, TicketState.EXPIRED})
MAX_TICKET_REPORTS = 1024
"""Reports in one ReportTickets call, at most (the coordinator refuses more)."""

TICKET_TRANSITIONS: dict[TicketState, frozenset[TicketState]] = {
    TicketState.OPEN: frozenset(
        {TicketState.PREFILLING, TicketState.TRANSFERRING, TicketState.DONE,
         TicketState.ABORTED, TicketState.EXPIRED}
    ),
    TicketState.PREFILLING: frozenset(
        {TicketState.TRANSFERRING, TicketState.DONE, TicketState.ABORTED, TicketState.EXPIRED}
    ),
    TicketState.TRANSFERRING: frozenset(
        {TicketState.DONE, TicketState.ABORTED, TicketState.EXPIRED}
    ),
    TicketState.DONE: frozenset(),
    TicketState.ABORTED: frozenset(),
    TicketState.EXPIRED: frozenset(),
}
"""Legal ticket moves. OPEN -> DONE directly is local prefill (no transfer)."""


@dataclass(frozen=True, slots=True, order=True)
class FencingToken:
    """Ticket id (a UUID, never reused) plus attempt. Whoever carries an old one is refused."""

    ticket_id: str
    attempt: int = 1

    @staticmethod
    def new() -> FencingToken:
        return FencingToken(ticket_id=str(uuid.uuid4()), attempt=1)

    def __str__(self) -> str:
        return f"{self.ticket_id}#{self.attempt}"

    @staticmethod
    def parse(text: str) -> FencingToken:
        ticket_id, _, attempt = text.rpartition("#")
        return FencingToken(ticket_id=ticket_id, attempt=int(attempt))


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """What a heartbeat says about a worker's load and KV memory."""

    num_queued_prefill_tokens: int = 0
    num_running_seqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_waiting_seqs: int = 0
    """Requests waiting in the engine's own queue (a self-scheduling engine reports it)."""


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker as the pool sees it. ``address`` is its gRPC agent; ``kv_address`` its data path."""

    worker_id: str
    deployment: str
    role: WorkerRole
    state: WorkerState
    address: str
    kv_address: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    last_heartbeat_s: float = 0.0
    registered_s: float = 0.0
    spec: bytes = b""
    """Static description (a serialized ``pdserve.api.v1.WorkerInfo``: engine, model, KV layout,
    transports). Opaque to the stores, which must round-trip it byte for byte."""


@dataclass(frozen=True, slots=True)
class DecodeWorkerView:
    """What opening a ticket checks of its decode worker, kept beside the worker's block ledger
    so the check and the reservation are one atomic step with no read before it: the
    deployment it serves, its lifecycle state and when its record expires (store clock). The
    pool manager writes it with every heartbeat and state change, so it is at most one
    heartbeat behind the record (``TicketLedger.describe_worker``)."""

    deployment: str
    state: WorkerState
    expires_s: float

    @staticmethod
    def of(record: WorkerRecord, ttl_s: float) -> DecodeWorkerView:
        """The view of a record just written with a time to live of ``ttl_s``."""
        return DecodeWorkerView(record.deployment, record.state, record.last_heartbeat_s + ttl_s)


@dataclass(frozen=True, slots=True)
class TicketSpec:
    """What the router asks for when it opens a ticket."""

    deployment: str
    decode_worker_id: str
    prefill_worker_id: str  # "" for local prefill on the decode worker
    num_blocks: int
    lease_s: float
    request_id: str = ""
    num_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Ticket:
    """A transfer ticket with its reservation. ``lease_deadline_s`` is coordinator-clock time."""

    token: FencingToken
    deployment: str
    decode_worker_id: str
    prefill_worker_id: str
    num_blocks: int
    state: TicketState
    is_held: bool
    lease_deadline_s: float
    created_s: float
    updated_s: float
    request_id: str = ""
    num_prompt_tokens: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """Statistics of one finished transfer, for the durable store and metrics."""

    ticket: Ticket
    num_bytes: int
    prefill_compute_s: float
    transfer_s: float
    exposed_s: float
    outcome: TicketState


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    """Block counts of one decode worker's ledger. Invariant: reserved + held <= total."""

    worker_id: str
    num_total_blocks: int
    num_reserved_blocks: int
    num_held_blocks: int

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - self.num_reserved_blocks - self.num_held_blocks


@dataclass(frozen=True, slots=True)
class BlockReport:
    """A decode worker's own account of its blocks, from a heartbeat, for reconciliation.

    ``blocks_by_token`` maps each fencing token (as ``str(token)``) that owns blocks on the worker
    to the number of blocks it owns there.
    """

    worker_id: str
    num_total_blocks: int
    blocks_by_token: dict[str, int]


@dataclass(frozen=True, slots=True)
class ReconcileResult:
    """What reconciliation changed: tickets the worker does not know (released) and held
    sequences the ledger did not know (adopted, e.g. after a store restart); and what the worker
    must change: tickets it reported that the ledger no longer holds for it (stale: freed, or at
    another attempt), which it drops."""

    released: tuple[str, ...]
    adopted: tuple[str, ...]
    snapshot: LedgerSnapshot
    stale: tuple[str, ...] = ()


class PoolEventKind(enum.StrEnum):
    UPSERTED = "upserted"
    REMOVED = "removed"
    TARGET = "target"


@dataclass(frozen=True, slots=True)
class PoolEvent:
    """One change in a deployment's pools. ``cursor`` orders events within one stream."""

    cursor: str
    kind: PoolEventKind
    deployment: str
    worker: WorkerRecord | None = None
    worker_id: str = ""


@dataclass(frozen=True, slots=True)
class PoolEvents:
    """A read of the change stream. ``is_gap`` means the reader missed events (trimmed history
    or a store restart) and must resync from ``snapshot``."""

    events: tuple[PoolEvent, ...]
    cursor: str
    is_gap: bool


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """All workers of a deployment plus the cursor to follow the stream from."""

    workers: tuple[WorkerRecord, ...]
    cursor: str


class ThresholdSource(enum.StrEnum):
    """Where a published local-prefill threshold comes from: the governor's planner, or an
    operator's pin (which the governor publishes instead of what it computes)."""

    COMPUTED = "computed"
    PINNED = "pinned"


@dataclass(frozen=True, slots=True)
class PublishedThreshold:
    """The local-prefill threshold in force for one deployment, as the hot state holds it:
    prompts with at most ``threshold_tokens`` uncached tokens prefill on the decode worker.
    ``version`` counts every publication of the deployment (1, 2, ...; it survives a clear);
    ``published_s`` is the publisher's wall clock."""

    deployment: str
    threshold_tokens: int
    source: ThresholdSource
    version: int
    published_s: float
