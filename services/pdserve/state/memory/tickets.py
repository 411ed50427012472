"""``TicketLedger`` in process memory: the block rules of the ``TicketLedger`` contract
(``pdserve.state.interfaces``) as plain dictionaries, each call atomic under the backend's lock."""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, replace

from pdserve.common.errors import (
    CapacityError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    StaleTokenError,
)
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    BlockReport,
    Clock,
    DecodeWorkerView,
    FencingToken,
    LedgerSnapshot,
    ReconcileResult,
    Ticket,
    TicketSpec,
    TicketState,
)
from pdserve.state.shared import (
    FREEING_STATES,
    REASON_ADOPTED,
    REASON_LEASE_EXPIRED,
    REASON_LEASE_EXPIRED_DONE,
    REASON_NOT_REPORTED,
    REASON_RELEASED,
    REASON_WORKER_DROPPED,
    BlockHolding,
    StateOptions,
    WorkerUnverifiedError,
    check_count,
    check_required,
    check_ttl,
    check_worker_view,
    ordered_tickets,
    parse_report,
)

MIN_RETRY_AFTER_S = 0.05
MAX_RETRY_AFTER_S = 5.0


def retry_after_s(now: float, lease_deadlines_s: list[float]) -> float:
    """Capacity retry hint: until the earliest lease on the worker lapses, within bounds."""
    if not lease_deadlines_s:
        return 1.0
    return min(max(min(lease_deadlines_s) - now, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)


@dataclass(slots=True)
class _Ledger:
    num_total_blocks: int
    num_reserved_blocks: int = 0
    num_held_blocks: int = 0
    view: DecodeWorkerView | None = None

    def snapshot(self, worker_id: str) -> LedgerSnapshot:
        return LedgerSnapshot(
            worker_id, self.num_total_blocks, self.num_reserved_blocks, self.num_held_blocks
        )


@dataclass(slots=True)
class _Entry:
    ticket: Ticket
    holding: BlockHolding
    purge_s: float | None = None


class MemoryTicketLedger:
    """``TicketLedger`` in process memory (block rules: ``TicketLedger``)."""

    def __init__(self, clock: Clock, options: StateOptions, lock: asyncio.Lock) -> None:
        self._clock = clock
        self._options = options
        self._lock = lock
        self._ledgers: dict[str, _Ledger] = {}
        self._entries: dict[str, _Entry] = {}
        self._ticket_ids_by_worker: dict[str, set[str]] = {}
        self._leases_by_worker: dict[str, dict[str, float]] = {}
        self._purge_heap: list[tuple[float, str]] = []

    async def set_capacity(
        self, worker_id: str, num_total_blocks: int, view: DecodeWorkerView | None = None
    ) -> LedgerSnapshot:
        check_required(worker_id, "worker_id")
        check_count(num_total_blocks, "num_total_blocks", 0)
        async with self._lock:
            ledger = self._ledgers.setdefault(worker_id, _Ledger(num_total_blocks))
            ledger.num_total_blocks = num_total_blocks
            if view is not None:
                ledger.view = view
            self._leases_by_worker.setdefault(worker_id, {})
            return ledger.snapshot(worker_id)

    async def describe_worker(self, worker_id: str, view: DecodeWorkerView) -> None:
        async with self._lock:
            ledger = self._ledgers.get(worker_id)
            if ledger is not None:
                ledger.view = view

    async def drop_worker(self, worker_id: str) -> list[Ticket]:
        async with self._lock:
            now = self._now()
            aborted = []
            for entry in self._live_entries(worker_id):
                if entry.ticket.state.is_terminal:
                    self._free(entry, now, reason=entry.ticket.reason or REASON_WORKER_DROPPED)
                else:
                    aborted.append(
                        self._free(
                            entry, now, state=TicketState.ABORTED, reason=REASON_WORKER_DROPPED
                        )
                    )
            self._ledgers.pop(worker_id, None)
            self._leases_by_worker.pop(worker_id, None)
            return ordered_tickets(aborted)

    async def open(self, spec: TicketSpec, *, should_check_worker: bool = False) -> Ticket:
        check_count(spec.num_prompt_tokens, "num_prompt_tokens", 0)
        async with self._lock:
            now = self._now()
            ledger = self._ledgers.get(spec.decode_worker_id)
            if ledger is None:
                raise InvalidArgumentError(
                    f"unknown decode worker {spec.decode_worker_id!r}", field="decode_worker_id"
                )
            if should_check_worker:
                if ledger.view is None:
                    raise WorkerUnverifiedError(spec.decode_worker_id)
                check_worker_view(ledger.view, spec, now)
            check_count(spec.num_blocks, "num_blocks", 1)
            if spec.num_blocks > ledger.num_total_blocks:
                raise InvalidArgumentError(
                    f"num_blocks: {spec.num_blocks} is more than decode worker "
                    f"{spec.decode_worker_id!r} has ({ledger.num_total_blocks})",
                    field="num_blocks",
                )
            check_ttl(spec.lease_s, "lease_s")
            leases = self._leases_by_worker[spec.decode_worker_id]
            num_free = ledger.snapshot(spec.decode_worker_id).num_free_blocks
            if num_free < spec.num_blocks:
                raise CapacityError(
                    f"decode worker {spec.decode_worker_id!r} has {num_free} free blocks, "
                    f"{spec.num_blocks} asked",
                    retry_after_s=retry_after_s(now, list(leases.values())),
                )
            ticket = Ticket(
                token=FencingToken.new(),
                deployment=spec.deployment,
                decode_worker_id=spec.decode_worker_id,
                prefill_worker_id=spec.prefill_worker_id,
                num_blocks=spec.num_blocks,
                state=TicketState.OPEN,
                is_held=False,
                lease_deadline_s=now + spec.lease_s,
                created_s=now,
                updated_s=now,
                request_id=spec.request_id,
                num_prompt_tokens=spec.num_prompt_tokens,
            )
            ledger.num_reserved_blocks += spec.num_blocks
            leases[ticket.token.ticket_id] = ticket.lease_deadline_s
            self._entries[ticket.token.ticket_id] = _Entry(ticket, BlockHolding.RESERVED)
            self._ticket_ids_by_worker.setdefault(spec.decode_worker_id, set()).add(
                ticket.token.ticket_id
            )
            return ticket

    async def get(self, token: FencingToken) -> Ticket:
        async with self._lock:
            return self._entry(token, self._now()).ticket

    async def find(self, ticket_id: str) -> Ticket | None:
        async with self._lock:
            self._now()
            entry = self._entries.get(ticket_id)
            return entry.ticket if entry else None

    async def transition(
        self, token: FencingToken, state: TicketState, reason: str = ""
    ) -> Ticket:
        state = TicketState(state)
        async with self._lock:
            now = self._now()
            return self._transition(self._entry(token, now), state, reason, now)

    def _transition(self, entry: _Entry, state: TicketState, reason: str, now: float) -> Ticket:
        current = entry.ticket.state
        if state not in TICKET_TRANSITIONS[current]:
            raise IllegalTransitionError(
                f"ticket {entry.ticket.token.ticket_id}: {current} -> {state} is not allowed"
            )
        reason = reason or entry.ticket.reason
        if state in FREEING_STATES:
            return self._free(entry, now, state=state, reason=reason)
        self._check_lease(entry, now)
        entry.ticket = replace(entry.ticket, state=state, reason=reason, updated_s=now)
        return entry.ticket

    async def extend(self, token: FencingToken, lease_s: float) -> Ticket:
        check_ttl(lease_s, "lease_s")
        async with self._lock:
            now = self._now()
            entry = self._entry(token, now)
            self._check_owned(entry)
            if entry.holding is BlockHolding.HELD:
                raise IllegalTransitionError(f"ticket {token.ticket_id} is held: it has no lease")
            self._check_lease(entry, now)
            entry.ticket = replace(entry.ticket, lease_deadline_s=now + lease_s, updated_s=now)
            self._leases_by_worker[entry.ticket.decode_worker_id][token.ticket_id] = (
                entry.ticket.lease_deadline_s
            )
            return entry.ticket

    async def mark_held(self, token: FencingToken) -> Ticket:
        async with self._lock:
            now = self._now()
            return self._mark_held(self._entry(token, now), now)

    async def hold_done(self, token: FencingToken) -> tuple[Ticket, bool]:
        async with self._lock:
            now = self._now()
            entry = self._entry(token, now)
            if entry.ticket.state is not TicketState.DONE:
                self._transition(entry, TicketState.DONE, "", now)
            if entry.holding is BlockHolding.HELD:
                return entry.ticket, False
            return self._mark_held(entry, now), True

    def _mark_held(self, entry: _Entry, now: float) -> Ticket:
        ticket_id = entry.ticket.token.ticket_id
        if entry.ticket.state is not TicketState.DONE:
            raise IllegalTransitionError(
                f"ticket {ticket_id} is {entry.ticket.state}: only DONE can be held"
            )
        self._check_owned(entry)
        if entry.holding is BlockHolding.HELD:
            return entry.ticket
        self._check_lease(entry, now)
        worker_id = entry.ticket.decode_worker_id
        ledger = self._ledgers[worker_id]
        ledger.num_reserved_blocks -= entry.ticket.num_blocks
        ledger.num_held_blocks += entry.ticket.num_blocks
        self._leases_by_worker[worker_id].pop(ticket_id, None)
        entry.holding = BlockHolding.HELD
        entry.ticket = replace(entry.ticket, is_held=True, lease_deadline_s=0.0, updated_s=now)
        return entry.ticket

    async def release(self, token: FencingToken) -> Ticket:
        async with self._lock:
            now = self._now()
            entry = self._entry(token, now)
            self._check_owned(entry)
            reason = entry.ticket.reason or REASON_RELEASED
            if entry.ticket.state.is_terminal:
                return self._free(entry, now, reason=reason)
            return self._free(entry, now, state=TicketState.ABORTED, reason=reason)

    async def reap_expired(self, worker_id: str | None = None) -> list[Ticket]:
        async with self._lock:
            now = self._now()
            worker_ids = [worker_id] if worker_id is not None else list(self._leases_by_worker)
            expired = []
            for one_worker_id in worker_ids:
                leases = self._leases_by_worker.get(one_worker_id, {})
                for ticket_id, deadline_s in list(leases.items()):
                    if deadline_s >= now:
                        continue
                    entry = self._entries[ticket_id]
                    if entry.ticket.state.is_terminal:
                        expired.append(self._free(entry, now, reason=REASON_LEASE_EXPIRED_DONE))
                    else:
                        expired.append(
                            self._free(
                                entry, now, state=TicketState.EXPIRED, reason=REASON_LEASE_EXPIRED
                            )
                        )
            return ordered_tickets(expired)

    async def snapshot(self, worker_id: str) -> LedgerSnapshot:
        async with self._lock:
            ledger = self._ledgers.get(worker_id)
            if ledger is None:
                raise NotFoundError(f"no ledger for decode worker {worker_id!r}")
            return ledger.snapshot(worker_id)

    async def list_tickets(
        self, worker_id: str | None = None, state: TicketState | None = None
    ) -> list[Ticket]:
        async with self._lock:
            self._now()
            if worker_id is None:
                entries = list(self._entries.values())
            else:
                ids = self._ticket_ids_by_worker.get(worker_id, set())
                entries = [self._entries[ticket_id] for ticket_id in ids]
            return ordered_tickets(
                [e.ticket for e in entries if state is None or e.ticket.state is state]
            )

    async def reconcile(self, report: BlockReport) -> ReconcileResult:
        reported = parse_report(report)
        worker_id = report.worker_id
        async with self._lock:
            now = self._now()
            ledger = self._ledgers.setdefault(worker_id, _Ledger(report.num_total_blocks))
            ledger.num_total_blocks = report.num_total_blocks
            self._leases_by_worker.setdefault(worker_id, {})
            adopted, stale = [], []
            for ticket_id, (attempt, num_blocks) in sorted(reported.items()):
                known = self._entries.get(ticket_id)
                if known is None:
                    token = FencingToken(ticket_id, attempt)
                    adopted.append(self._adopt(worker_id, token, num_blocks, now))
                elif known.holding is BlockHolding.FREE or known.ticket.token.attempt != attempt:
                    stale.append(str(FencingToken(ticket_id, attempt)))
            released = []
            cutoff_s = now - self._options.reconcile_grace_s
            for entry in self._live_entries(worker_id):
                token = entry.ticket.token
                if reported.get(token.ticket_id, (0, 0))[0] == token.attempt:
                    continue
                if entry.ticket.created_s >= cutoff_s:
                    continue
                new_state = None if entry.ticket.state.is_terminal else TicketState.ABORTED
                self._free(entry, now, state=new_state, reason=REASON_NOT_REPORTED)
                released.append(str(token))
            return ReconcileResult(
                released=tuple(sorted(released)),
                adopted=tuple(sorted(adopted)),
                snapshot=ledger.snapshot(worker_id),
                stale=tuple(sorted(stale)),
            )

    # -- internals (call with the lock held) ---------------------------------------------------

    def _now(self) -> float:
        """The clock reading, after forgetting tickets whose retention ended."""
        now = self._clock()
        while self._purge_heap and self._purge_heap[0][0] <= now:
            _, ticket_id = heapq.heappop(self._purge_heap)
            entry = self._entries.get(ticket_id)
            if entry is not None and entry.purge_s is not None and entry.purge_s <= now:
                del self._entries[ticket_id]
                ids = self._ticket_ids_by_worker.get(entry.ticket.decode_worker_id)
                if ids is not None:
                    ids.discard(ticket_id)
                    if not ids:
                        del self._ticket_ids_by_worker[entry.ticket.decode_worker_id]
        return now

    def _entry(self, token: FencingToken, now: float) -> _Entry:
        entry = self._entries.get(token.ticket_id)
        if entry is None:
            raise StaleTokenError(f"unknown ticket {token.ticket_id}")
        if entry.ticket.token.attempt != token.attempt:
            raise StaleTokenError(
                f"ticket {token.ticket_id} is at attempt {entry.ticket.token.attempt}, "
                f"not {token.attempt}"
            )
        return entry

    @staticmethod
    def _check_owned(entry: _Entry) -> None:
        if entry.holding is BlockHolding.FREE:
            raise StaleTokenError(
                f"ticket {entry.ticket.token.ticket_id} no longer owns blocks "
                f"({entry.ticket.state}, {entry.ticket.reason or 'freed'})"
            )

    @staticmethod
    def _check_lease(entry: _Entry, now: float) -> None:
        if entry.holding is BlockHolding.RESERVED and entry.ticket.lease_deadline_s < now:
            raise StaleTokenError(f"ticket {entry.ticket.token.ticket_id}: lease lapsed")

    def _live_entries(self, worker_id: str) -> list[_Entry]:
        ids = self._ticket_ids_by_worker.get(worker_id, set())
        entries = [self._entries[ticket_id] for ticket_id in ids]
        live = [entry for entry in entries if entry.holding is not BlockHolding.FREE]
        return sorted(live, key=lambda e: (e.ticket.created_s, e.ticket.token.ticket_id))

    def _free(
        self, entry: _Entry, now: float, *, state: TicketState | None = None, reason: str
    ) -> Ticket:
        """Give the entry's blocks back to its ledger (if the ledger still exists) exactly once."""
        assert entry.holding is not BlockHolding.FREE
        worker_id = entry.ticket.decode_worker_id
        ledger = self._ledgers.get(worker_id)
        if ledger is not None:
            if entry.holding is BlockHolding.RESERVED:
                ledger.num_reserved_blocks -= entry.ticket.num_blocks
            else:
                ledger.num_held_blocks -= entry.ticket.num_blocks
        self._leases_by_worker.get(worker_id, {}).pop(entry.ticket.token.ticket_id, None)
        entry.holding = BlockHolding.FREE
        entry.purge_s = now + self._options.ticket_retention_s
        heapq.heappush(self._purge_heap, (entry.purge_s, entry.ticket.token.ticket_id))
        entry.ticket = replace(
            entry.ticket,
            state=state or entry.ticket.state,
            is_held=False,
            reason=reason,
            updated_s=now,
        )
        return entry.ticket

    def _adopt(self, worker_id: str, token: FencingToken, num_blocks: int, now: float) -> str:
        ticket = Ticket(
            token=token,
            deployment="",
            decode_worker_id=worker_id,
            prefill_worker_id="",
            num_blocks=num_blocks,
            state=TicketState.DONE,
            is_held=True,
            lease_deadline_s=0.0,
            created_s=now,
            updated_s=now,
            reason=REASON_ADOPTED,
        )
        self._entries[token.ticket_id] = _Entry(ticket, BlockHolding.HELD)
        self._ticket_ids_by_worker.setdefault(worker_id, set()).add(token.ticket_id)
        self._ledgers[worker_id].num_held_blocks += num_blocks
        return str(token)
