"""The KV-transfer coordinator core: tickets over the shared ledger, leases, the reaper, the
fan-out that tells both workers when a ticket ends early, and transfer statistics.

The ledger (``TicketLedger``) does the atomic parts; this class adds validation against the pool
(a ticket goes only to a READY decode worker of the right deployment), lease bounds, notification
and statistics. It holds no state of its own that matters after a restart: the ledger is shared,
and a restarted coordinator's reaper picks up every lapsed lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from pdserve.common.errors import (
    InvalidArgumentError,
    NotFoundError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.types import (
    Clock,
    DecodeWorkerView,
    FencingToken,
    LedgerSnapshot,
    Ticket,
    TicketSpec,
    TicketState,
    TransferRecord,
    WorkerRole,
)
from pdserve.kv_transfer import metrics
from pdserve.state.interfaces import TicketLedger, WorkerStore
from pdserve.state.shared import WorkerUnverifiedError, check_worker_view

logger = logging.getLogger(__name__)


PREFILL_RECHECK_S = 5.0
"""How long a prefill worker once seen in the pool is taken as one without reading its record."""
MAX_KNOWN_PREFILL = 4096


@dataclass(frozen=True, slots=True)
class CoordinatorPolicy:
    """Lease bounds and reaper cadence, seconds."""

    default_lease_s: float = 10.0
    max_lease_s: float = 300.0
    reap_interval_s: float = 0.5


class TicketNotifier(Protocol):
    """Tells the workers of a ticket that it ended early (aborted or expired)."""

    async def ticket_ended(self, ticket: Ticket) -> None: ...


class TransferStatsSink(Protocol):
    """Where a finished transfer's statistics go (the durable store): one record per (ticket,
    attempt) however often it is given (a repeated DONE report gives it again)."""

    def record(self, record: TransferRecord) -> None: ...

    async def spooled(self) -> None:
        """Until the records given so far are safe (in the spool or written)."""
        ...


class NullNotifier:
    async def ticket_ended(self, ticket: Ticket) -> None:
        return None


_PROGRESS_ORDER = {
    TicketState.OPEN: 0,
    TicketState.PREFILLING: 1,
    TicketState.TRANSFERRING: 2,
    TicketState.DONE: 3,
}


def _is_behind(reported: TicketState, current: TicketState) -> bool:
    """A progress report that arrives after the ticket moved past it (reports travel off the
    token path, so PREFILLING can land after DONE)."""
    if current.is_terminal:
        return reported is not TicketState.DONE or current is TicketState.DONE
    return _PROGRESS_ORDER.get(reported, 9) < _PROGRESS_ORDER.get(current, 0)


class KvTransferCoordinator:
    def __init__(
        self,
        ledger: TicketLedger,
        workers: WorkerStore,
        clock: Clock,
        policy: CoordinatorPolicy | None = None,
        notifier: TicketNotifier | None = None,
        stats_sink: TransferStatsSink | None = None,
    ) -> None:
        self._ledger = ledger
        self._workers = workers
        self._clock = clock
        self.policy = policy or CoordinatorPolicy()
        self._notifier = notifier or NullNotifier()
        self._stats_sink = stats_sink
        self._subscribers: set[asyncio.Queue[Ticket]] = set()
        self._known_prefill: dict[str, float] = {}
        """Prefill worker id -> until when it is taken as one without reading its record."""

    @property
    def clock(self) -> Clock:
        return self._clock

    def lease_s(self, requested_ms: int) -> float:
        if requested_ms < 0:
            raise InvalidArgumentError("lease_ms: must be >= 0", field="lease_ms")
        if requested_ms == 0:
            return self.policy.default_lease_s
        return min(requested_ms / 1000.0, self.policy.max_lease_s)

    async def open_ticket(self, spec: TicketSpec) -> Ticket:
        if not spec.deployment:
            raise InvalidArgumentError("deployment: required", field="deployment")
        if not spec.decode_worker_id:
            raise InvalidArgumentError("decode_worker_id: required", field="decode_worker_id")
        if spec.num_blocks <= 0:
            raise InvalidArgumentError("num_blocks: must be > 0", field="num_blocks")
        if spec.prefill_worker_id and not self._is_known_prefill(spec.prefill_worker_id):
            await self._check_prefill(spec.prefill_worker_id)
        try:
            try:
                # The decode worker is checked in the ledger's own step (its view beside the
                # ledger): one round trip, no record read first.
                ticket = await self._ledger.open(spec, should_check_worker=True)
            except WorkerUnverifiedError:
                # No view there (written by a pool manager of an earlier release, or not yet):
                # the record, read here, then the same open without the check.
                await self._check_decode(spec)
                ticket = await self._ledger.open(spec)
        except InvalidArgumentError as exc:
            if exc.field != "decode_worker_id" or not exc.message.startswith("unknown"):
                raise
            # No ledger: the record says why (read only on this path). Not a decode worker
            # of the pool, or a READY one whose ledger the store lost while its record was
            # kept (a Redis Cluster master that failed over before replicating it): its next
            # heartbeat writes the ledger again, so retry.
            await self._check_decode(spec)
            raise UnavailableError(f"decode worker {spec.decode_worker_id} has no block ledger "
                                   "in the store (not in the pool, or until its next "
                                   "heartbeat)") from exc
        self._publish(ticket)
        return ticket

    async def _check_decode(self, spec: TicketSpec) -> None:
        decode = await self._workers.get(spec.decode_worker_id)
        if decode is None:
            # Not (or no longer, or not yet again after a store restart) in the pool: callers
            # retry elsewhere or after the next heartbeat re-adopts it.
            raise UnavailableError(f"decode worker {spec.decode_worker_id} is not in the pool")
        if decode.role is not WorkerRole.DECODE:
            raise InvalidArgumentError(
                f"decode_worker_id: no decode worker {spec.decode_worker_id!r}",
                field="decode_worker_id",
            )
        check_worker_view(DecodeWorkerView(decode.deployment, decode.state, math.inf), spec,
                          self._clock())

    def _is_known_prefill(self, worker_id: str) -> bool:
        until = self._known_prefill.get(worker_id)
        return until is not None and until > self._clock()

    async def _check_prefill(self, worker_id: str) -> None:
        """The prefill worker must be a prefill worker of the pool. A worker seen to be one is
        taken as one for ``PREFILL_RECHECK_S`` (a role never changes; a worker that left since
        fails its prefill call instead), so the hot path reads no record of it."""
        prefill = await self._workers.get(worker_id)
        if prefill is None:
            raise UnavailableError(f"prefill worker {worker_id} is not in the pool")
        if prefill.role is not WorkerRole.PREFILL:
            raise InvalidArgumentError(
                f"prefill_worker_id: no prefill worker {worker_id!r}", field="prefill_worker_id")
        known = self._known_prefill
        known.pop(worker_id, None)
        if len(known) >= MAX_KNOWN_PREFILL:
            del known[next(iter(known))]
        known[worker_id] = self._clock() + PREFILL_RECHECK_S

    async def update_progress(
        self, token: FencingToken, state: TicketState,
        record: TransferRecord | Callable[[Ticket], TransferRecord] | None = None,
    ) -> Ticket:
        """Move the ticket forward (a repeated or late report changes nothing). On DONE its
        blocks become held and ``record``, the transfer's statistics, is kept: a record, or a
        function of the held ticket that makes it (so no read of the ticket comes first)."""
        if state is TicketState.DONE:
            # One step: DONE (a repeated report changes nothing) and the blocks held.
            ticket, is_first_done = await self._ledger.hold_done(token)
            if callable(record):
                record = record(ticket)
            if record is not None:
                if is_first_done:
                    metrics.observe_transfer(ticket.deployment, record.num_bytes,
                                             record.transfer_s, record.exposed_s)
                if self._stats_sink is not None:
                    # Given again on a repeated DONE: the first report's answer may have been
                    # lost with a replica that died after holding the blocks and before the
                    # record was safe (the store keeps one per ticket and attempt). DONE is
                    # acknowledged once the record is safe, never before.
                    self._stats_sink.record(record)
                    await self._stats_sink.spooled()
        else:
            current = await self._ledger.get(token)
            if state is current.state:
                ticket = current  # a repeated report (a retried call) changes nothing
            elif _is_behind(state, current.state):
                return current  # a late progress report after a later state: ignore, don't fail
            else:
                ticket = await self._ledger.transition(token, state)
        self._publish(ticket)
        return ticket

    async def renew(self, token: FencingToken, lease_s: float) -> Ticket:
        return await self._ledger.extend(token, lease_s)

    async def abort(self, token: FencingToken, reason: str) -> Ticket:
        ticket = await self._ledger.get(token)
        if ticket.state.is_terminal:
            if ticket.state is TicketState.DONE:
                # A finished ticket being cancelled: its blocks (held by the sequence, or still
                # reserved if mark_held never ran) go back now rather than at lease expiry.
                with contextlib.suppress(StaleTokenError):
                    ticket = await self._ledger.release(token)
            return ticket
        ticket = await self._ledger.transition(token, TicketState.ABORTED, reason or "aborted")
        self._publish(ticket)
        await self._notify(ticket)
        return ticket

    async def release(self, token: FencingToken) -> Ticket:
        ticket = await self._ledger.release(token)
        self._publish(ticket)
        return ticket

    async def get(self, ticket_id: str) -> Ticket | None:
        return await self._ledger.find(ticket_id)

    async def list_tickets(
        self, worker_id: str | None = None, state: TicketState | None = None
    ) -> list[Ticket]:
        return await self._ledger.list_tickets(worker_id, state)

    async def ledgers(
        self, worker_id: str | None = None, deployment: str | None = None
    ) -> list[LedgerSnapshot]:
        """Ledger counts of one decode worker, or of every decode worker (of a deployment)."""
        if worker_id:
            return [await self._ledger.snapshot(worker_id)]
        workers = await self._workers.list(deployment, WorkerRole.DECODE)
        snapshots = []
        for worker in workers:
            try:
                snapshots.append(await self._ledger.snapshot(worker.worker_id))
            except NotFoundError:
                continue  # a failed or departing worker whose ledger was dropped already
        return snapshots

    async def reap_once(self) -> list[Ticket]:
        expired = await self._ledger.reap_expired()
        for ticket in expired:
            logger.info("ticket %s expired (decode %s)", ticket.token, ticket.decode_worker_id)
            self._publish(ticket)
            await self._notify(ticket)
        return expired

    async def run_reaper(self, stop: asyncio.Event) -> None:
        """Reap until ``stop`` is set. Errors are logged and the loop goes on (store restarts)."""
        while not stop.is_set():
            try:
                await self.reap_once()
            except Exception:
                logger.exception("reaper pass failed")
            try:
                await asyncio.wait_for(stop.wait(), self.policy.reap_interval_s)
            except TimeoutError:
                pass

    async def watch(self, worker_id: str = "") -> AsyncIterator[Ticket]:
        """Ticket changes made through this replica, optionally only those touching a worker."""
        queue: asyncio.Queue[Ticket] = asyncio.Queue(maxsize=10_000)
        self._subscribers.add(queue)
        try:
            while True:
                ticket = await queue.get()
                if not worker_id or worker_id in (
                    ticket.decode_worker_id,
                    ticket.prefill_worker_id,
                ):
                    yield ticket
        finally:
            self._subscribers.discard(queue)

    def _publish(self, ticket: Ticket) -> None:
        metrics.observe_ticket(ticket)
        for queue in list(self._subscribers):
            if queue.full():
                continue  # a slow watcher misses changes rather than slowing the coordinator
            queue.put_nowait(ticket)

    async def _notify(self, ticket: Ticket) -> None:
        try:
            await self._notifier.ticket_ended(ticket)
        except Exception:
            logger.warning("could not notify workers of ticket %s", ticket.token, exc_info=True)
