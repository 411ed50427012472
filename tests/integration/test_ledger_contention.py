"""The ticket ledger under contention on a real Redis that restarts mid-run.

32 "router" tasks open, advance, extend, hold, release, abort and abandon tickets on 4 decode
workers while a reaper task moves the injected clock and reaps lapsed leases, and every task now
and then presents a token that must be refused. A private redis-server (never the shared one) is
stopped while calls are in flight and started again empty; the ledger is then rebuilt from what
the model decode workers hold (``set_capacity`` + ``reconcile``).

Checked throughout: no snapshot ever shows reserved + held > total; every ticket's blocks are
freed at most once, whoever frees them (release, abort, reaper); a call is refused only when the
model allows it (freed, lost in the restart, lease lapsed, or the call overlapped the restart);
dead and forged tokens are always refused. At quiescent points (mid-run, after the restart, at
the end) the ledger equals the model exactly, and after releasing and reaping everything every
block is free.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import pytest
from helpers import StepClock
from helpers.private_redis import private_redis

from pdserve.common.errors import (
    CapacityError,
    IllegalTransitionError,
    PdserveError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    BlockReport,
    FencingToken,
    Ticket,
    TicketSpec,
    TicketState,
)
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.interfaces import StateBackend

NUM_TASKS = 32
NUM_OPS = 2400
WORKER_IDS = ("d0", "d1", "d2", "d3")
NUM_TOTAL_BLOCKS = 48
CHECKPOINT_AT_OPS = NUM_OPS // 3
RESTART_AT_OPS = 2 * NUM_OPS // 3

T = TypeVar("T")

pytestmark = pytest.mark.timeout(120)


class Holding(enum.StrEnum):
    RESERVED = "reserved"
    HELD = "held"
    FREE = "free"
    LOST = "lost"  # its store was lost in the restart and no worker held it: unknown from now on


@dataclass
class Tracked:
    token: FencingToken
    worker_id: str
    num_blocks: int
    state: TicketState
    holding: Holding
    deadline_s: float
    generation: int
    num_frees: int = 0


@dataclass
class Model:
    """What the ledger must contain, built from calls known to have run on the current store,
    plus what each decode worker holds (its own truth, which survives the store)."""

    clock: StepClock
    generation: int = 0
    is_store_down: bool = False
    num_ops: int = 0
    num_in_flight: int = 0
    tickets: dict[FencingToken, Tracked] = field(default_factory=dict)
    worker_holds: dict[str, dict[FencingToken, int]] = field(
        default_factory=lambda: {w: {} for w in WORKER_IDS}
    )
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def free(self, tracked: Tracked, ticket: Ticket, how: str) -> None:
        assert tracked.holding in (Holding.RESERVED, Holding.HELD), (
            f"{how} freed {tracked.token} again (it was {tracked.holding})"
        )
        assert not ticket.is_held
        tracked.holding = Holding.FREE
        tracked.state = ticket.state
        tracked.num_frees += 1

    def usage(self, worker_id: str) -> tuple[int, int]:
        mine = [t for t in self.tickets.values() if t.worker_id == worker_id]
        return (
            sum(t.num_blocks for t in mine if t.holding is Holding.RESERVED),
            sum(t.num_blocks for t in mine if t.holding is Holding.HELD),
        )

    def may_be_refused(self, tracked: Tracked) -> bool:
        """A call on this ticket may be refused: it is freed or lost, or its lease lapsed (the
        reaper may have expired it; the ledger refuses a lapsed lease anyway)."""
        return tracked.holding in (Holding.FREE, Holding.LOST) or (
            tracked.holding is Holding.RESERVED and tracked.deadline_s < self.clock()
        )

    def released(self, tracked: Tracked, ticket: Ticket) -> None:
        """A held sequence's blocks came back (one adopted after the restart, maybe)."""
        self.free(tracked, ticket, "release")
        self.count("released held")
        if tracked.generation != self.generation:
            self.count("released adopted")


@dataclass
class Outcome:
    """A call's result or error. ``is_certain``: it ran on the current store, so the model
    follows it; otherwise it overlapped the restart and only the workers' own truth follows."""

    result: object
    error: PdserveError | None
    is_certain: bool


@dataclass
class Run:
    backend: StateBackend
    model: Model
    ready: asyncio.Event
    errors: list[BaseException] = field(default_factory=list)

    async def call(
        self, make: Callable[[], Awaitable[object]], *, is_counted: bool = True
    ) -> Outcome:
        """One ledger call once the store is usable. ``is_counted``: counts towards ``NUM_OPS``
        (the reaper's snapshots do not, nor do calls that found the store down)."""
        await self.ready.wait()
        model = self.model
        generation, was_down = model.generation, model.is_store_down
        model.num_in_flight += 1
        try:
            result, error = await make(), None
        except UnavailableError as unavailable:
            result, error = None, unavailable
            model.count("unavailable")
            await asyncio.sleep(0.005)  # back off while Redis is down
        except PdserveError as refused:
            result, error = None, refused
        finally:
            model.num_in_flight -= 1
        is_certain = generation == model.generation and not (was_down or model.is_store_down)
        assert is_certain or model.generation > 0
        if isinstance(error, UnavailableError):
            assert not is_certain, f"store unavailable outside the restart: {error!r}"
        else:
            model.num_ops += is_counted
        return Outcome(result, error, is_certain)


def check_refusal(model: Model, tracked: Tracked, outcome: Outcome) -> None:
    error = outcome.error
    assert outcome.result is None and error is not None
    if not outcome.is_certain:
        return
    assert isinstance(error, StaleTokenError | IllegalTransitionError), repr(error)
    assert model.may_be_refused(tracked), f"{tracked} refused: {error!r}"
    model.count("refused (lapsed or gone)")


async def router(run: Run, seed: int) -> None:
    """Opens tickets and drives them to the end, like a router with its decode worker."""
    rng = random.Random(seed)
    mine: list[Tracked] = []
    while run.model.num_ops < NUM_OPS:
        await run.ready.wait()  # decide on the model as it is when the store is usable
        mine = [t for t in mine if t.holding in (Holding.RESERVED, Holding.HELD)]
        roll = rng.random()
        if not mine or (roll < 0.25 and len(mine) < 4):
            await open_one(run, rng, mine)
        elif roll < 0.31:
            await refused_token(run, rng)
        elif roll < 0.35:
            await illegal_move(run, rng.choice(mine))
        elif roll < 0.39:
            abandon(run, mine)
        elif roll < 0.50:
            await extend(run, rng, rng.choice(mine))
        elif roll < 0.57:
            await abort(run, rng, rng.choice(mine))
        else:
            await advance(run, rng, rng.choice(mine))
        await asyncio.sleep(0)


def abandon(run: Run, mine: list[Tracked]) -> None:
    """Forget a reserved ticket, as a crashed router would: only the reaper frees it now."""
    reserved = [t for t in mine if t.holding is Holding.RESERVED]
    if reserved:
        mine.remove(reserved[0])
        run.model.count("abandoned")


async def open_one(run: Run, rng: random.Random, mine: list[Tracked]) -> None:
    model = run.model
    worker_id = rng.choice(WORKER_IDS)
    spec = TicketSpec(
        deployment="llama", decode_worker_id=worker_id, prefill_worker_id="p",
        num_blocks=rng.randint(1, 8), lease_s=rng.uniform(1.0, 4.0),
    )
    outcome = await run.call(lambda: run.backend.tickets.open(spec))
    if isinstance(outcome.error, CapacityError):
        assert outcome.error.retry_after_s > 0
        model.count("capacity refused")
        return
    if outcome.error is not None:
        assert not outcome.is_certain, f"open failed: {outcome.error!r}"
        return
    ticket = outcome.result
    assert isinstance(ticket, Ticket)
    # An uncertain open can only have run on the store being lost (the new one has no ledger
    # until the routers are let back in): it is reserved there, until the restart sorts it out.
    generation = model.generation if outcome.is_certain else model.generation - 1
    tracked = Tracked(ticket.token, worker_id, spec.num_blocks, ticket.state, Holding.RESERVED,
                      ticket.lease_deadline_s, generation)
    model.tickets[ticket.token] = tracked
    mine.append(tracked)
    model.count("opened")


async def advance(run: Run, rng: random.Random, tracked: Tracked) -> None:
    tickets, model = run.backend.tickets, run.model
    if tracked.holding is Holding.HELD:
        await end_sequence(run, tracked)
        return
    if tracked.state is TicketState.DONE:
        outcome = await run.call(lambda: tickets.mark_held(tracked.token))
        if outcome.error is not None:
            check_refusal(model, tracked, outcome)
            return
        assert isinstance(outcome.result, Ticket) and outcome.result.is_held
        model.worker_holds[tracked.worker_id][tracked.token] = tracked.num_blocks
        if outcome.is_certain:  # else: the restart sorts it out from the worker's holdings
            assert tracked.holding is Holding.RESERVED, tracked
            tracked.holding = Holding.HELD
        model.count("held")
        return
    if tracked.state is TicketState.OPEN:
        target = TicketState.PREFILLING if rng.random() < 0.7 else TicketState.DONE
    else:
        target = {TicketState.PREFILLING: TicketState.TRANSFERRING,
                  TicketState.TRANSFERRING: TicketState.DONE}[tracked.state]
    outcome = await run.call(lambda: tickets.transition(tracked.token, target))
    if outcome.error is not None:
        check_refusal(model, tracked, outcome)
        return
    assert isinstance(outcome.result, Ticket) and outcome.result.state is target
    if outcome.is_certain:
        assert tracked.holding is Holding.RESERVED, tracked
        tracked.state = target
    model.count("moved")


async def end_sequence(run: Run, tracked: Tracked) -> None:
    """The sequence ends on the decode worker (it stops holding the blocks), then the ledger
    gets them back. Held blocks are freed by nobody else, so only a restart excuses a refusal."""
    model = run.model
    model.worker_holds[tracked.worker_id].pop(tracked.token, None)
    outcome = await run.call(lambda: run.backend.tickets.release(tracked.token))
    if outcome.error is None:
        assert isinstance(outcome.result, Ticket)
        if outcome.is_certain:
            model.released(tracked, outcome.result)
    elif outcome.is_certain:
        assert isinstance(outcome.error, StaleTokenError), repr(outcome.error)
        assert tracked.holding is Holding.LOST, f"{tracked} refused: {outcome.error!r}"


async def extend(run: Run, rng: random.Random, tracked: Tracked) -> None:
    if tracked.holding is not Holding.RESERVED:
        return
    lease_s = rng.uniform(1.0, 4.0)
    outcome = await run.call(lambda: run.backend.tickets.extend(tracked.token, lease_s))
    if outcome.error is not None:
        check_refusal(run.model, tracked, outcome)
        return
    assert isinstance(outcome.result, Ticket)
    if outcome.is_certain:
        assert tracked.holding is Holding.RESERVED, tracked
        tracked.deadline_s = outcome.result.lease_deadline_s
    run.model.count("extended")


async def abort(run: Run, rng: random.Random, tracked: Tracked) -> None:
    if tracked.holding is not Holding.RESERVED:
        return
    tickets, model = run.backend.tickets, run.model
    by_release = rng.random() < 0.5 or tracked.state.is_terminal
    if by_release:
        outcome = await run.call(lambda: tickets.release(tracked.token))
    else:
        outcome = await run.call(
            lambda: tickets.transition(tracked.token, TicketState.ABORTED, "cancelled")
        )
    if outcome.error is not None:
        check_refusal(model, tracked, outcome)
        return
    assert isinstance(outcome.result, Ticket)
    if outcome.is_certain:
        model.free(tracked, outcome.result, "release" if by_release else "abort")
    model.count("aborted")


async def illegal_move(run: Run, tracked: Tracked) -> None:
    """OPEN is never a legal target: refused as illegal, or as stale if the ticket is gone."""
    assert all(TicketState.OPEN not in targets for targets in TICKET_TRANSITIONS.values())
    outcome = await run.call(
        lambda: run.backend.tickets.transition(tracked.token, TicketState.OPEN)
    )
    assert outcome.result is None, "an illegal transition was accepted"
    if not isinstance(outcome.error, IllegalTransitionError):
        check_refusal(run.model, tracked, outcome)
    run.model.count("illegal refused")


async def refused_token(run: Run, rng: random.Random) -> None:
    """A token that owns nothing: freed, lost in the restart, or forged. Always refused."""
    model = run.model
    dead = [t for t in model.tickets.values() if t.holding in (Holding.FREE, Holding.LOST)]
    if dead and rng.random() < 0.8:
        token = rng.choice(dead).token
    elif model.tickets and rng.random() < 0.5:
        token = FencingToken(rng.choice(list(model.tickets)).ticket_id, attempt=2)
    else:
        token = FencingToken.new()
    tickets = run.backend.tickets
    for make in (lambda: tickets.release(token), lambda: tickets.extend(token, 5.0)):
        outcome = await run.call(make)
        assert outcome.result is None, f"the dead token {token} was accepted"
        assert isinstance(outcome.error, StaleTokenError | UnavailableError), repr(outcome.error)
    model.count("stale refused")


async def reaper(run: Run, rng: random.Random) -> None:
    """Moves the clock and reaps; checks the no-over-allocation invariant on every snapshot."""
    model, tickets = run.model, run.backend.tickets
    while model.num_ops < NUM_OPS:
        model.clock.advance(rng.uniform(0.2, 0.8))
        outcome = await run.call(lambda: tickets.reap_expired())
        if outcome.error is None and outcome.is_certain:
            assert isinstance(outcome.result, list)
            for ticket in outcome.result:
                assert ticket.lease_deadline_s < model.clock()
                tracked = model.tickets[ticket.token]
                assert tracked.holding is Holding.RESERVED, f"reaped {tracked}"
                model.free(tracked, ticket, "reaper")
                model.count("reaped")
        for worker_id in WORKER_IDS:
            outcome = await run.call(lambda w=worker_id: tickets.snapshot(w), is_counted=False)
            snapshot = outcome.result
            if snapshot is not None:
                assert snapshot.num_reserved_blocks >= 0 and snapshot.num_held_blocks >= 0
                assert snapshot.num_free_blocks >= 0, f"over-allocated: {snapshot}"
                model.count("snapshots")
        await asyncio.sleep(0)


async def retried(make: Callable[[], Awaitable[T]]) -> T:
    """A call that is safe to repeat (set_capacity, reconcile, snapshot) right after a restart."""
    for _ in range(50):
        try:
            return await make()
        except UnavailableError:
            await asyncio.sleep(0.02)
    raise AssertionError("the restarted Redis never answered")


async def quiesce(model: Model) -> None:
    while model.num_in_flight:
        await asyncio.sleep(0.002)


async def assert_ledger_equals_model(backend: StateBackend, model: Model) -> None:
    for worker_id in WORKER_IDS:
        snapshot = await retried(lambda w=worker_id: backend.tickets.snapshot(w))
        assert (snapshot.num_total_blocks, snapshot.num_reserved_blocks,
                snapshot.num_held_blocks) == (NUM_TOTAL_BLOCKS, *model.usage(worker_id))
        listed = {t.token: t for t in await backend.tickets.list_tickets(worker_id)}
        for tracked in model.tickets.values():
            if tracked.worker_id != worker_id or tracked.holding is Holding.LOST:
                continue
            if tracked.holding is Holding.FREE and tracked.generation != model.generation:
                continue  # freed before the store was lost, and gone with it
            ticket = listed[tracked.token]
            assert ticket.state is tracked.state, (ticket, tracked)
            assert ticket.is_held == (tracked.holding is Holding.HELD), (ticket, tracked)


async def checkpoints(run: Run, stop: Callable[[], None], start: Callable[[], None]) -> None:
    """A quiescent check a third of the way, then a Redis restart with calls in flight."""
    model, backend = run.model, run.backend
    while model.num_ops < CHECKPOINT_AT_OPS:
        await asyncio.sleep(0.002)
    run.ready.clear()
    await quiesce(model)
    await assert_ledger_equals_model(backend, model)
    model.count("checkpoints")
    run.ready.set()

    while model.num_ops < RESTART_AT_OPS:
        await asyncio.sleep(0.002)
    model.generation += 1
    model.is_store_down = True
    await asyncio.to_thread(stop)  # routers keep calling: calls in flight and new ones fail
    run.ready.clear()  # routers wait until the ledger is rebuilt
    await asyncio.to_thread(start)
    await quiesce(model)
    model.is_store_down = False
    for tracked in model.tickets.values():
        if tracked.holding in (Holding.RESERVED, Holding.HELD):
            is_held_by_worker = tracked.token in model.worker_holds[tracked.worker_id]
            tracked.holding = Holding.HELD if is_held_by_worker else Holding.LOST
            if is_held_by_worker:
                tracked.state = TicketState.DONE
    for worker_id in WORKER_IDS:
        # Routers are paused, so set_capacity may come first; a live system reconciles first.
        await retried(lambda w=worker_id: backend.tickets.set_capacity(w, NUM_TOTAL_BLOCKS))
        holds = model.worker_holds[worker_id]
        report = BlockReport(worker_id, NUM_TOTAL_BLOCKS, {str(t): n for t, n in holds.items()})
        result = await retried(lambda r=report: backend.tickets.reconcile(r))
        assert set(result.adopted) == {str(t) for t in holds}
        assert result.released == ()
        assert result.snapshot.num_held_blocks == sum(holds.values())
        assert result.snapshot.num_reserved_blocks == 0
    await assert_ledger_equals_model(backend, model)
    model.count("restarts")
    run.ready.set()


async def guarded(run: Run, job: Awaitable[None]) -> None:
    """Stops every task at the first failure, so the test reports it instead of hanging."""
    try:
        await job
    except BaseException as error:
        run.errors.append(error)
        run.model.num_ops = NUM_OPS
        run.ready.set()
        raise


async def finish(backend: StateBackend, model: Model) -> None:
    """Every sequence ends, every lease lapses, the reaper takes the rest: all blocks free."""
    for holds in model.worker_holds.values():
        for token in list(holds):
            del holds[token]
            model.released(model.tickets[token], await backend.tickets.release(token))
    model.clock.advance(10.0)  # past every lease (at most 4 s)
    for ticket in await backend.tickets.reap_expired():
        model.free(model.tickets[ticket.token], ticket, "reaper")
    for worker_id in WORKER_IDS:
        snapshot = await backend.tickets.snapshot(worker_id)
        assert snapshot.num_free_blocks == NUM_TOTAL_BLOCKS, snapshot
    await assert_ledger_equals_model(backend, model)
    assert all(t.holding in (Holding.FREE, Holding.LOST) for t in model.tickets.values())
    assert all(t.num_frees <= 1 for t in model.tickets.values())


async def test_ledger_under_contention_with_a_redis_restart() -> None:
    rng = random.Random(20240917)
    model = Model(StepClock())
    with private_redis() as server:
        backend = open_backend(server.url, model.clock, StateOptions(key_prefix="pdcontention"))
        try:
            for worker_id in WORKER_IDS:
                await backend.tickets.set_capacity(worker_id, NUM_TOTAL_BLOCKS)
            run = Run(backend, model, asyncio.Event())
            run.ready.set()
            jobs = [router(run, rng.randrange(2**32)) for _ in range(NUM_TASKS)]
            jobs += [reaper(run, random.Random(rng.randrange(2**32))),
                     checkpoints(run, server.stop, server.start)]
            await asyncio.gather(*(guarded(run, job) for job in jobs), return_exceptions=True)
            if run.errors:
                raise run.errors[0]
            await quiesce(model)
            await assert_ledger_equals_model(backend, model)
            await finish(backend, model)
        finally:
            await backend.close()

    counts = model.counts
    print(f"\nledger contention: {model.num_ops} ops {dict(sorted(counts.items()))}")
    assert model.num_ops >= 2000
    assert counts["restarts"] == 1 and counts["checkpoints"] == 1
    for what in ("opened", "moved", "held", "released held", "extended", "aborted", "abandoned",
                 "reaped", "stale refused", "illegal refused", "capacity refused", "unavailable",
                 "snapshots"):
        assert counts.get(what, 0) > 0, f"the run never exercised {what!r}: {counts}"
    assert any(t.holding is Holding.LOST for t in model.tickets.values()), "restart lost nothing"
    assert counts.get("released adopted", 0) > 0, "no sequence outlived the restart"
