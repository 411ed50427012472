"""Helpers shared by tests: a clock the test moves by hand, a private redis-server
(``helpers.private_redis``), and a model-checking state machine for ticket ledgers."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from pdserve.common.errors import (
    CapacityError,
    IllegalTransitionError,
    InvalidArgumentError,
    PdserveError,
    StaleTokenError,
)
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    BlockReport,
    FencingToken,
    TicketSpec,
    TicketState,
)
from pdserve.state.factory import StateOptions, open_backend

T = TypeVar("T")


class StepClock:
    """Seconds that move only when the test says so (an injected ``Clock``)."""

    def __init__(self, start_s: float = 1_000_000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> float:
        assert seconds >= 0, "time never goes backwards"
        self.now_s += seconds
        return self.now_s


WORKER_IDS = ("a", "b")
NUM_TOTAL_BLOCKS = (12, 20)
GRACE_S = 1.0

T = TypeVar("T")


@dataclass
class Expected:
    worker_id: str
    num_blocks: int
    state: TicketState
    holding: str  # "reserved" | "held" | "free"
    deadline_s: float
    created_s: float


class LedgerModelMachine(RuleBasedStateMachine):
    """Drives one backend's ticket ledger with random calls and predicts every outcome
    (including which error) from a plain model; after every step each worker's counts must
    equal the model's and stay within its total. ``state_url`` picks the backend (None: memory;
    a Redis URL: a fresh random key prefix per run, deleted afterwards)."""

    state_url: str | None = None
    tokens = Bundle("tokens")

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = StepClock()
        options = StateOptions(
            key_prefix=f"pdtest-{uuid.uuid4().hex[:12]}",
            ticket_retention_s=1e9,
            reconcile_grace_s=GRACE_S,
        )
        self.backend = open_backend(self.state_url, self.clock, options)
        self.ledger = self.backend.tickets
        self.totals: dict[str, int] = {}
        self.expected: dict[FencingToken, Expected] = {}

    def teardown(self) -> None:
        client = getattr(self.backend, "client", None)
        if client is not None:
            prefix = f"{self.backend.keys.prefix}:*"  # type: ignore[attr-defined]

            async def delete_keys() -> None:
                keys = [key async for key in client.scan_iter(match=prefix)]
                if keys:
                    await client.delete(*keys)

            self.run(delete_keys())
        self.run(self.backend.close())
        self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def outcome(self, coroutine: Coroutine[Any, Any, Any]) -> tuple[Any, PdserveError | None]:
        """(result, None) or (None, the pdserve error it raised)."""
        try:
            return self.run(coroutine), None
        except PdserveError as error:
            return None, error

    def used(self, worker_id: str, holding: str) -> int:
        return sum(
            e.num_blocks for e in self.expected.values()
            if e.worker_id == worker_id and e.holding == holding
        )

    def lapsed(self, e: Expected) -> bool:
        return e.holding == "reserved" and e.deadline_s < self.clock()

    @initialize()
    def create_ledgers(self) -> None:
        for worker_id, total in zip(WORKER_IDS, NUM_TOTAL_BLOCKS, strict=True):
            self.run(self.ledger.set_capacity(worker_id, total))
            self.totals[worker_id] = total

    @rule(
        target=tokens,
        worker_id=st.sampled_from(WORKER_IDS),
        num_blocks=st.integers(1, 10),
        lease_s=st.sampled_from((1.0, 3.0, 10.0)),
    )
    def open(self, worker_id: str, num_blocks: int, lease_s: float) -> FencingToken:
        return self._open(worker_id, num_blocks, lease_s)

    @rule(
        target=tokens,
        worker_id=st.sampled_from((*WORKER_IDS, "unknown")),
        num_blocks=st.integers(-1, 26),
        lease_s=st.sampled_from((-1.0, 0.0, 0.5)),
    )
    def open_anything(self, worker_id: str, num_blocks: int, lease_s: float) -> FencingToken:
        return self._open(worker_id, num_blocks, lease_s)

    def _open(self, worker_id: str, num_blocks: int, lease_s: float) -> FencingToken:
        spec = TicketSpec("llama", worker_id, "p", num_blocks, lease_s)
        ticket, error = self.outcome(self.ledger.open(spec))
        total = self.totals.get(worker_id)
        if total is None or num_blocks < 1 or num_blocks > total or lease_s <= 0:
            assert isinstance(error, InvalidArgumentError)
            return FencingToken.new()  # never opened: a token that must stay stale
        free = total - self.used(worker_id, "reserved") - self.used(worker_id, "held")
        if free < num_blocks:
            assert isinstance(error, CapacityError)
            return FencingToken.new()
        assert error is None and ticket.state is TicketState.OPEN
        self.expected[ticket.token] = Expected(
            worker_id, num_blocks, TicketState.OPEN, "reserved", self.clock() + lease_s,
            self.clock(),
        )
        return ticket.token

    @rule(token=tokens, is_local=st.booleans())
    def advance(self, token: FencingToken, is_local: bool) -> None:
        """The happy path: OPEN -> PREFILLING (or DONE, local prefill) -> TRANSFERRING -> DONE,
        then held."""
        e = self.expected.get(token)
        if e is None or e.state is TicketState.DONE:
            self.mark_held(token)
            return
        next_state = {
            TicketState.OPEN: TicketState.DONE if is_local else TicketState.PREFILLING,
            TicketState.PREFILLING: TicketState.TRANSFERRING,
            TicketState.TRANSFERRING: TicketState.DONE,
        }.get(e.state, TicketState.DONE)
        self.transition(token, next_state)

    @rule(token=tokens, target_state=st.sampled_from(list(TicketState)))
    def transition(self, token: FencingToken, target_state: TicketState) -> None:
        ticket, error = self.outcome(self.ledger.transition(token, target_state))
        e = self.expected.get(token)
        if e is None:
            assert isinstance(error, StaleTokenError)
        elif target_state not in TICKET_TRANSITIONS[e.state]:
            assert isinstance(error, IllegalTransitionError)
        elif target_state in (TicketState.ABORTED, TicketState.EXPIRED):
            assert error is None and ticket.state is target_state and not ticket.is_held
            e.state, e.holding = target_state, "free"
        elif self.lapsed(e):
            assert isinstance(error, StaleTokenError)
        else:
            assert error is None and ticket.state is target_state
            e.state = target_state

    @rule(token=tokens, lease_s=st.sampled_from((0.5, 2.0)))
    def extend(self, token: FencingToken, lease_s: float) -> None:
        ticket, error = self.outcome(self.ledger.extend(token, lease_s))
        e = self.expected.get(token)
        if e is None or e.holding == "free" or self.lapsed(e):
            assert isinstance(error, StaleTokenError)
        elif e.holding == "held":
            assert isinstance(error, IllegalTransitionError)
        else:
            assert error is None and ticket.lease_deadline_s == self.clock() + lease_s
            e.deadline_s = ticket.lease_deadline_s

    @rule(token=tokens)
    def mark_held(self, token: FencingToken) -> None:
        ticket, error = self.outcome(self.ledger.mark_held(token))
        e = self.expected.get(token)
        if e is None:
            assert isinstance(error, StaleTokenError)
        elif e.state is not TicketState.DONE:
            assert isinstance(error, IllegalTransitionError)
        elif e.holding == "free" or self.lapsed(e):
            assert isinstance(error, StaleTokenError)
        else:
            assert error is None and ticket.is_held
            e.holding = "held"

    @rule(token=consumes(tokens))
    def release(self, token: FencingToken) -> None:
        ticket, error = self.outcome(self.ledger.release(token))
        e = self.expected.get(token)
        if e is None or e.holding == "free":
            assert isinstance(error, StaleTokenError)
            return
        assert error is None and not ticket.is_held
        e.holding = "free"
        if not e.state.is_terminal:
            e.state = TicketState.ABORTED
        assert ticket.state is e.state
        again, error = self.outcome(self.ledger.release(token))
        assert again is None and isinstance(error, StaleTokenError)

    @rule(seconds=st.sampled_from((0.5, 2.0)))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(worker_id=st.sampled_from((None, *WORKER_IDS)))
    def reap(self, worker_id: str | None) -> None:
        reaped = self.run(self.ledger.reap_expired(worker_id))
        due = {
            token for token, e in self.expected.items()
            if self.lapsed(e) and worker_id in (None, e.worker_id)
        }
        assert {t.token for t in reaped} == due
        for ticket in reaped:
            e = self.expected[ticket.token]
            e.holding = "free"
            if not e.state.is_terminal:
                e.state = TicketState.EXPIRED
            assert ticket.state is e.state

    @rule(worker_id=st.sampled_from(WORKER_IDS), data=st.data())
    def reconcile(self, worker_id: str, data: st.DataObject) -> None:
        """The worker reports some of what the ledger has live there: the rest, if older than
        the grace period, is released; nothing is adopted (every reported token is known)."""
        live = [  # in opening order: what is drawn must not depend on the random ticket ids
            t for t, e in self.expected.items() if e.worker_id == worker_id and e.holding != "free"
        ]
        is_reported = data.draw(st.lists(st.booleans(), min_size=len(live), max_size=len(live)))
        reported = [t for t, is_in in zip(live, is_reported, strict=True) if is_in]
        report = {str(t): self.expected[t].num_blocks for t in reported}
        total = self.totals[worker_id]
        if sum(report.values()) > total:
            return
        result = self.run(self.ledger.reconcile(BlockReport(worker_id, total, report)))
        released = {
            str(t) for t in live
            if t not in reported and self.expected[t].created_s < self.clock() - GRACE_S
        }
        assert set(result.released) == released and result.adopted == ()
        for text in released:
            e = self.expected[FencingToken.parse(text)]
            e.holding = "free"
            if not e.state.is_terminal:
                e.state = TicketState.ABORTED

    @invariant()
    def ledgers_match_the_model(self) -> None:
        for worker_id, total in self.totals.items():
            snapshot = self.run(self.ledger.snapshot(worker_id))
            assert snapshot.num_total_blocks == total
            assert snapshot.num_reserved_blocks == self.used(worker_id, "reserved")
            assert snapshot.num_held_blocks == self.used(worker_id, "held")
            assert 0 <= snapshot.num_free_blocks <= total
