"""One contract for every hot-state backend: each test runs against real Redis (a random key
prefix on the shared server, removed afterwards) and against the in-process memory backend.

Time is a ``StepClock`` injected into the backend; leases and retention move only with it.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
from helpers import LedgerModelMachine, StepClock
from helpers.private_redis_ha import private_redis_cluster, private_sentinel
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from pdserve.common.errors import (
    CapacityError,
    IllegalTransitionError,
    InvalidArgumentError,
    NotFoundError,
    StaleTokenError,
    UnavailableError,
)
from pdserve.common.tokenizer_bundle import TokenizerBundle
from pdserve.common.types import (
    TICKET_TRANSITIONS,
    BlockReport,
    DecodeWorkerView,
    FencingToken,
    PoolEvent,
    PoolEventKind,
    ThresholdSource,
    Ticket,
    TicketSpec,
    TicketState,
    WorkerLoad,
    WorkerRecord,
    WorkerRole,
    WorkerState,
)
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.interfaces import StateBackend
from pdserve.state.redis.backend import RedisStateBackend
from pdserve.state.redis.keys import RedisKeys
from pdserve.state.redis.tickets import BACKSTOP_MARGIN_S
from pdserve.state.shared import WorkerUnverifiedError

RETENTION_S = 60.0
GRACE_S = 30.0
STREAM_MAX_LEN = 10
LEASE_S = 5.0


@dataclass
class Harness:
    """A backend under test, its clock, and a way to lose all of its state (a store restart)."""

    url: str | None
    clock: StepClock
    options: StateOptions
    backend: StateBackend

    async def lose_state(self) -> StateBackend:
        """Forget everything, as a restarted store would; returns the backend to use now."""
        if isinstance(self.backend, RedisStateBackend):
            await _delete_prefix(self.backend)
        await self.backend.close()
        self.backend = open_backend(self.url, self.clock, self.options)
        return self.backend


async def _delete_prefix(backend: RedisStateBackend) -> None:
    keys = [key async for key in backend.client.scan_iter(match=f"{backend.keys.prefix}:*")]
    if keys:
        await backend.client.delete(*keys)


@pytest.fixture(scope="module")
def redis_cluster_url() -> Iterator[str]:
    """A private Redis Cluster (3 masters + 3 replicas) for this module."""
    with private_redis_cluster() as cluster:
        yield cluster.url


@pytest.fixture(scope="module")
def redis_sentinel_url() -> Iterator[str]:
    """A private master + replica behind three sentinels, for this module."""
    with private_sentinel() as sentinel:
        yield sentinel.url


_URL_FIXTURE = {"redis": "redis_url", "cluster": "redis_cluster_url",
                "sentinel": "redis_sentinel_url"}


@pytest.fixture(params=["memory", "redis", "cluster", "sentinel"])
def state_url(request: pytest.FixtureRequest) -> str | None:
    """Every backend: in-process, one Redis, a Redis Cluster, a Sentinel-managed master."""
    if request.param == "memory":
        return None
    return str(request.getfixturevalue(_URL_FIXTURE[request.param]))


@pytest.fixture
async def harness(state_url: str | None) -> AsyncIterator[Harness]:
    clock = StepClock()
    options = StateOptions(
        key_prefix=f"pdtest-{uuid.uuid4().hex[:12]}",
        ticket_retention_s=RETENTION_S,
        reconcile_grace_s=GRACE_S,
        stream_max_len=STREAM_MAX_LEN,
    )
    harness = Harness(state_url, clock, options, open_backend(state_url, clock, options))
    yield harness
    if isinstance(harness.backend, RedisStateBackend):
        await _delete_prefix(harness.backend)
    await harness.backend.close()


def spec(worker_id: str = "d1", num_blocks: int = 4, lease_s: float = LEASE_S) -> TicketSpec:
    return TicketSpec(
        deployment="llama", decode_worker_id=worker_id, prefill_worker_id="p1",
        num_blocks=num_blocks, lease_s=lease_s, request_id="req-1", num_prompt_tokens=100,
    )


async def used_blocks(backend: StateBackend, worker_id: str = "d1") -> tuple[int, int]:
    snapshot = await backend.tickets.snapshot(worker_id)
    return snapshot.num_reserved_blocks, snapshot.num_held_blocks


_PATH_TO: dict[TicketState, tuple[TicketState, ...]] = {
    TicketState.OPEN: (),
    TicketState.PREFILLING: (TicketState.PREFILLING,),
    TicketState.TRANSFERRING: (TicketState.PREFILLING, TicketState.TRANSFERRING),
    TicketState.DONE: (TicketState.DONE,),
    TicketState.ABORTED: (TicketState.ABORTED,),
    TicketState.EXPIRED: (TicketState.EXPIRED,),
}


async def ticket_in(backend: StateBackend, state: TicketState, num_blocks: int = 4) -> Ticket:
    ticket = await backend.tickets.open(spec(num_blocks=num_blocks))
    for step in _PATH_TO[state]:
        ticket = await backend.tickets.transition(ticket.token, step)
    assert ticket.state is state
    return ticket


# -- ledger ---------------------------------------------------------------------------------


async def test_set_capacity_creates_resizes_and_snapshot_needs_a_ledger(harness: Harness) -> None:
    tickets = harness.backend.tickets
    with pytest.raises(NotFoundError):
        await tickets.snapshot("d1")
    created = await tickets.set_capacity("d1", 16)
    assert (created.num_total_blocks, created.num_free_blocks) == (16, 16)
    await tickets.open(spec(num_blocks=4))
    resized = await tickets.set_capacity("d1", 32)
    assert (resized.num_total_blocks, resized.num_reserved_blocks, resized.num_free_blocks) == (
        32, 4, 28,
    )
    assert await tickets.snapshot("d1") == resized
    with pytest.raises(InvalidArgumentError):
        await tickets.set_capacity("d1", -1)


async def test_open_reserves_blocks_under_a_lease(harness: Harness) -> None:
    tickets, now = harness.backend.tickets, harness.clock()
    await tickets.set_capacity("d1", 16)
    ticket = await tickets.open(spec(num_blocks=6))
    assert uuid.UUID(ticket.token.ticket_id).version == 4
    assert ticket.token.attempt == 1
    assert (ticket.state, ticket.is_held, ticket.num_blocks) == (TicketState.OPEN, False, 6)
    assert (ticket.created_s, ticket.updated_s) == (now, now)
    assert ticket.lease_deadline_s == now + LEASE_S
    assert (ticket.deployment, ticket.decode_worker_id, ticket.prefill_worker_id) == (
        "llama", "d1", "p1",
    )
    assert (ticket.request_id, ticket.num_prompt_tokens) == ("req-1", 100)
    assert await used_blocks(harness.backend) == (6, 0)
    assert await tickets.get(ticket.token) == ticket
    assert await tickets.find(ticket.token.ticket_id) == ticket
    assert await tickets.find(str(uuid.uuid4())) is None
    second = await tickets.open(spec(num_blocks=10))
    assert second.token != ticket.token
    assert await used_blocks(harness.backend) == (16, 0)


@pytest.mark.parametrize(
    ("worker_id", "num_blocks", "lease_s", "field"),
    [
        ("nobody", 4, LEASE_S, "decode_worker_id"),
        ("d1", 0, LEASE_S, "num_blocks"),
        ("d1", -3, LEASE_S, "num_blocks"),
        ("d1", 17, LEASE_S, "num_blocks"),
        ("d1", 4, 0.0, "lease_s"),
        ("d1", 4, -1.0, "lease_s"),
        ("d1", 4, float("nan"), "lease_s"),
    ],
)
async def test_open_refuses_invalid_arguments_and_reserves_nothing(
    harness: Harness, worker_id: str, num_blocks: int, lease_s: float, field: str
) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    with pytest.raises(InvalidArgumentError) as error:
        await tickets.open(spec(worker_id, num_blocks, lease_s))
    assert error.value.field == field
    assert await used_blocks(harness.backend) == (0, 0)
    assert await tickets.list_tickets() == []


async def test_open_without_capacity_is_refused_with_a_retry_hint(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 10)
    first = await tickets.open(spec(num_blocks=7))
    with pytest.raises(CapacityError) as error:
        await tickets.open(spec(num_blocks=4))
    assert 0 < error.value.retry_after_s <= LEASE_S
    assert await used_blocks(harness.backend) == (7, 0)
    assert [t.token for t in await tickets.list_tickets()] == [first.token]
    fits = await tickets.open(spec(num_blocks=3))  # exactly the free rest
    assert fits.num_blocks == 3
    assert (await tickets.snapshot("d1")).num_free_blocks == 0


async def test_every_legal_transition_is_accepted(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 1000)
    for source, targets in TICKET_TRANSITIONS.items():
        for target in targets:
            ticket = await ticket_in(harness.backend, source)
            reserved_before, _ = await used_blocks(harness.backend)
            harness.clock.advance(0.5)
            moved = await tickets.transition(ticket.token, target, reason="why")
            assert (moved.state, moved.updated_s) == (target, harness.clock())
            assert moved.reason == "why"
            freed = target in (TicketState.ABORTED, TicketState.EXPIRED)
            reserved_after, _ = await used_blocks(harness.backend)
            assert reserved_before - reserved_after == (ticket.num_blocks if freed else 0)
            assert await tickets.get(ticket.token) == moved


async def test_every_illegal_transition_is_refused_and_changes_nothing(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 1000)
    num_refused = 0
    for source in TicketState:
        for target in TicketState:
            if target in TICKET_TRANSITIONS[source]:
                continue
            ticket = await ticket_in(harness.backend, source)
            before = (await used_blocks(harness.backend), await tickets.get(ticket.token))
            with pytest.raises(IllegalTransitionError):
                await tickets.transition(ticket.token, target)
            assert (await used_blocks(harness.backend), await tickets.get(ticket.token)) == before
            num_refused += 1
    assert num_refused == 36 - sum(len(t) for t in TICKET_TRANSITIONS.values())


async def test_unknown_tickets_and_other_attempts_are_stale(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    ticket = await tickets.open(spec())
    unknown = FencingToken.new()
    other_attempt = FencingToken(ticket.token.ticket_id, attempt=2)
    for token in (unknown, other_attempt):
        for call in (tickets.get, tickets.mark_held, tickets.release):
            with pytest.raises(StaleTokenError):
                await call(token)
        for state in (TicketState.PREFILLING, TicketState.ABORTED):
            with pytest.raises(StaleTokenError):
                await tickets.transition(token, state)
        with pytest.raises(StaleTokenError):
            await tickets.extend(token, 10.0)
    assert await tickets.get(ticket.token) == ticket
    assert await used_blocks(harness.backend) == (4, 0)


async def test_extend_moves_the_deadline_and_needs_a_live_lease(harness: Harness) -> None:
    tickets, clock = harness.backend.tickets, harness.clock
    await tickets.set_capacity("d1", 16)
    ticket = await tickets.open(spec())
    clock.advance(4.0)
    extended = await tickets.extend(ticket.token, 20.0)
    assert extended.lease_deadline_s == clock() + 20.0
    for bad in (0.0, -1.0):
        with pytest.raises(InvalidArgumentError):
            await tickets.extend(ticket.token, bad)
    clock.advance(20.0)  # exactly at the deadline the lease still holds
    await tickets.extend(ticket.token, 1.0)
    clock.advance(1.5)  # lapsed, not yet reaped
    with pytest.raises(StaleTokenError):
        await tickets.extend(ticket.token, 10.0)
    with pytest.raises(StaleTokenError):
        await tickets.transition(ticket.token, TicketState.PREFILLING)
    assert [t.token for t in await tickets.reap_expired()] == [ticket.token]

    held = await ticket_in(harness.backend, TicketState.DONE)
    await tickets.mark_held(held.token)
    with pytest.raises(IllegalTransitionError):
        await tickets.extend(held.token, 10.0)
    await tickets.release(held.token)
    with pytest.raises(StaleTokenError):
        await tickets.extend(held.token, 10.0)


async def test_reaper_expires_lapsed_leases_and_frees_their_blocks(harness: Harness) -> None:
    tickets, clock = harness.backend.tickets, harness.clock
    await tickets.set_capacity("d1", 32)
    await tickets.set_capacity("d2", 32)
    short = await tickets.open(spec(lease_s=5.0))
    long = await tickets.open(spec(lease_s=50.0))
    other = await tickets.open(spec("d2", lease_s=5.0))
    prefilling = await tickets.transition(
        (await tickets.open(spec(lease_s=5.0))).token, TicketState.PREFILLING
    )
    held = await tickets.mark_held((await ticket_in(harness.backend, TicketState.DONE)).token)
    done = await ticket_in(harness.backend, TicketState.DONE)  # DONE but never marked held
    clock.advance(5.0)
    assert await tickets.reap_expired() == []  # deadline == now is not lapsed
    clock.advance(0.01)
    reaped = await tickets.reap_expired("d1")
    assert {t.token for t in reaped} == {short.token, prefilling.token, done.token}
    by_token = {t.token: t for t in reaped}
    assert by_token[short.token].state is TicketState.EXPIRED
    assert by_token[prefilling.token].state is TicketState.EXPIRED
    assert by_token[done.token].state is TicketState.DONE
    assert all(t.reason for t in reaped)
    assert await used_blocks(harness.backend, "d1") == (long.num_blocks, held.num_blocks)
    assert await used_blocks(harness.backend, "d2") == (4, 0)  # not this worker's reaper pass
    assert await tickets.reap_expired("d1") == []
    assert [t.token for t in await tickets.reap_expired()] == [other.token]
    assert await used_blocks(harness.backend, "d2") == (0, 0)
    assert (await tickets.get(short.token)).state is TicketState.EXPIRED
    with pytest.raises(IllegalTransitionError):
        await tickets.transition(short.token, TicketState.PREFILLING)
    with pytest.raises(StaleTokenError):
        await tickets.release(short.token)
    with pytest.raises(StaleTokenError):
        await tickets.mark_held(done.token)
    clock.advance(1000.0)  # held blocks have no lease
    assert [t.token for t in await tickets.reap_expired()] == [long.token]
    assert await used_blocks(harness.backend, "d1") == (0, held.num_blocks)


async def test_mark_held_then_release_frees_exactly_once(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    ticket = await ticket_in(harness.backend, TicketState.TRANSFERRING, num_blocks=5)
    with pytest.raises(IllegalTransitionError):
        await tickets.mark_held(ticket.token)
    done = await tickets.transition(ticket.token, TicketState.DONE)
    assert (done.is_held, await used_blocks(harness.backend)) == (False, (5, 0))
    held = await tickets.mark_held(ticket.token)
    assert held.is_held and held.state is TicketState.DONE
    assert await used_blocks(harness.backend) == (0, 5)
    assert await tickets.mark_held(ticket.token) == held  # idempotent
    assert await used_blocks(harness.backend) == (0, 5)
    released = await tickets.release(ticket.token)
    assert (released.state, released.is_held) == (TicketState.DONE, False)
    assert await used_blocks(harness.backend) == (0, 0)
    with pytest.raises(StaleTokenError):
        await tickets.release(ticket.token)
    with pytest.raises(StaleTokenError):
        await tickets.mark_held(ticket.token)
    assert await used_blocks(harness.backend) == (0, 0)
    assert (await tickets.get(ticket.token)).state is TicketState.DONE


async def test_hold_done_is_done_then_held_in_one_step(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 32)
    for state in (TicketState.OPEN, TicketState.PREFILLING, TicketState.TRANSFERRING,
                  TicketState.DONE):
        ticket = await ticket_in(harness.backend, state, num_blocks=2)
        reserved, held = await used_blocks(harness.backend)
        done, is_first = await tickets.hold_done(ticket.token)
        assert (done.state, done.is_held, is_first) == (TicketState.DONE, True, True)
        assert await used_blocks(harness.backend) == (reserved - 2, held + 2)
        again, is_first = await tickets.hold_done(ticket.token)  # a repeated DONE
        assert (again, is_first) == (done, False)
        assert await used_blocks(harness.backend) == (reserved - 2, held + 2)
        await tickets.release(ticket.token)
        with pytest.raises(StaleTokenError):  # released: a late DONE holds nothing again
            await tickets.hold_done(ticket.token)
    aborted = await ticket_in(harness.backend, TicketState.ABORTED, num_blocks=2)
    with pytest.raises(IllegalTransitionError):
        await tickets.hold_done(aborted.token)
    lapsed = await ticket_in(harness.backend, TicketState.TRANSFERRING, num_blocks=3)
    harness.clock.advance(LEASE_S + 1)
    with pytest.raises(StaleTokenError):
        await tickets.hold_done(lapsed.token)
    assert (await tickets.get(lapsed.token)).state is TicketState.TRANSFERRING
    assert await used_blocks(harness.backend) == (3, 0)  # the reaper frees it, not DONE
    with pytest.raises(StaleTokenError):
        await tickets.hold_done(FencingToken.new())


async def test_release_of_reserved_blocks_aborts_a_live_ticket(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    live = await ticket_in(harness.backend, TicketState.PREFILLING)
    released = await tickets.release(live.token)
    assert released.state is TicketState.ABORTED and released.reason
    done = await ticket_in(harness.backend, TicketState.DONE)
    assert (await tickets.release(done.token)).state is TicketState.DONE
    assert await used_blocks(harness.backend) == (0, 0)
    aborted = await ticket_in(harness.backend, TicketState.ABORTED)
    with pytest.raises(StaleTokenError):  # aborting freed them already
        await tickets.release(aborted.token)
    assert await used_blocks(harness.backend) == (0, 0)


async def test_finished_tickets_are_kept_for_the_retention_then_forgotten(harness: Harness) -> None:
    tickets, clock = harness.backend.tickets, harness.clock
    await tickets.set_capacity("d1", 16)
    finished = await ticket_in(harness.backend, TicketState.ABORTED)
    live = await ticket_in(harness.backend, TicketState.DONE)
    await tickets.mark_held(live.token)
    clock.advance(RETENTION_S - 1)
    assert (await tickets.get(finished.token)).state is TicketState.ABORTED
    clock.advance(1)
    with pytest.raises(StaleTokenError):
        await tickets.get(finished.token)
    assert await tickets.find(finished.token.ticket_id) is None
    assert [t.token for t in await tickets.list_tickets()] == [live.token]
    assert (await tickets.get(live.token)).is_held  # held tickets never age out


async def test_list_tickets_filters_by_worker_and_state(harness: Harness) -> None:
    tickets, clock = harness.backend.tickets, harness.clock
    await tickets.set_capacity("d1", 16)
    await tickets.set_capacity("d2", 16)
    a = await tickets.open(spec("d1"))
    clock.advance(1)
    b = await tickets.open(spec("d2"))
    clock.advance(1)
    c = await tickets.transition((await tickets.open(spec("d1"))).token, TicketState.ABORTED)
    assert [t.token for t in await tickets.list_tickets()] == [a.token, b.token, c.token]
    assert [t.token for t in await tickets.list_tickets("d1")] == [a.token, c.token]
    assert [t.token for t in await tickets.list_tickets(state=TicketState.OPEN)] == [
        a.token, b.token,
    ]
    assert [t.token for t in await tickets.list_tickets("d1", TicketState.ABORTED)] == [c.token]
    assert await tickets.list_tickets("d3") == []


async def test_drop_worker_aborts_its_tickets_and_forgets_its_ledger(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    await tickets.set_capacity("d2", 16)
    live = await ticket_in(harness.backend, TicketState.TRANSFERRING)
    held = await tickets.mark_held((await ticket_in(harness.backend, TicketState.DONE)).token)
    elsewhere = await tickets.open(spec("d2"))
    dropped = await tickets.drop_worker("d1")
    assert [(t.token, t.state) for t in dropped] == [(live.token, TicketState.ABORTED)]
    with pytest.raises(NotFoundError):
        await tickets.snapshot("d1")
    with pytest.raises(InvalidArgumentError):
        await tickets.open(spec("d1"))
    with pytest.raises(StaleTokenError):
        await tickets.release(held.token)  # the sequence died with the worker
    assert (await tickets.get(live.token)).state is TicketState.ABORTED
    assert await used_blocks(harness.backend, "d2") == (4, 0)
    assert await tickets.get(elsewhere.token) == elsewhere
    assert await tickets.drop_worker("d1") == []
    assert await tickets.drop_worker("never-seen") == []


def view(state: WorkerState = WorkerState.READY, deployment: str = "llama",
         expires_s: float = 0.0) -> DecodeWorkerView:
    return DecodeWorkerView(deployment, state, expires_s)


async def test_open_checks_the_decode_workers_view_in_the_same_step(harness: Harness) -> None:
    tickets, now = harness.backend.tickets, harness.clock()
    await tickets.describe_worker("d1", view())  # no ledger yet: nothing is kept
    with pytest.raises(NotFoundError):
        await tickets.snapshot("d1")
    await tickets.set_capacity("d1", 16)
    with pytest.raises(WorkerUnverifiedError):  # a ledger an earlier release wrote: no view
        await tickets.open(spec(), should_check_worker=True)
    await tickets.open(spec())  # the caller checked the record itself
    await tickets.set_capacity("d1", 16, view(expires_s=now + 10))
    opened = await tickets.open(spec(), should_check_worker=True)
    assert opened.decode_worker_id == "d1"
    refusals = [
        (view(WorkerState.DRAINING, expires_s=now + 10), UnavailableError, "is draining"),
        (view(deployment="qwen", expires_s=now + 10), InvalidArgumentError, "serves 'qwen'"),
        (view(expires_s=now - 1), UnavailableError, "not in the pool"),
    ]
    for worker_view, error, message in refusals:
        await tickets.describe_worker("d1", worker_view)
        with pytest.raises(error, match=message) as caught:
            await tickets.open(spec(), should_check_worker=True)
        if error is InvalidArgumentError:
            assert caught.value.field == "decode_worker_id"
        assert await used_blocks(harness.backend) == (8, 0)  # nothing reserved by a refusal
    await tickets.describe_worker("d1", view(expires_s=now + 10))
    harness.clock.advance(11)  # the record's expiry passes with no heartbeat to extend it
    with pytest.raises(UnavailableError, match="not in the pool"):
        await tickets.open(spec(lease_s=60.0), should_check_worker=True)


async def test_a_ticket_is_found_by_its_id_alone(harness: Harness) -> None:
    """Another replica (no memory of the open) finds a ticket by id; on a cluster, its id index
    lies in its decode worker's slot, so nothing on another master is needed."""
    if harness.url is None:
        pytest.skip("memory state is one process's")
    await harness.backend.tickets.set_capacity("d1", 16)
    ticket = await harness.backend.tickets.open(spec())
    other = open_backend(harness.url, harness.clock, harness.options)
    try:
        assert await other.tickets.get(ticket.token) == ticket
        assert (await other.tickets.release(ticket.token)).token == ticket.token
    finally:
        await other.close()
    if isinstance(harness.backend, RedisStateBackend) and isinstance(
        harness.backend.client, RedisCluster
    ):
        keys = harness.backend.keys
        assert key_slot(keys.ticket_owner(ticket.token.ticket_id).encode()) == key_slot(
            keys.ledger("d1").encode())


async def test_a_freed_tickets_id_index_lives_as_long_as_its_retention(harness: Harness) -> None:
    """Released or aborted, a ticket needs its id index (both of them: this release's and the
    earlier one's) only as long as the ticket itself is kept; until then the index outlives
    it by far (it must find tickets held for a long sequence)."""
    backend = harness.backend
    if not isinstance(backend, RedisStateBackend):
        pytest.skip("the id index is Redis's")
    await backend.tickets.set_capacity("d1", 16)
    keys = backend.keys
    released = await backend.tickets.open(spec())
    aborted = await backend.tickets.open(spec())
    backstop_ms = (RETENTION_S + BACKSTOP_MARGIN_S) * 1000
    index_ttl_ms = harness.options.ticket_index_ttl_s * 1000
    assert index_ttl_ms > 2 * backstop_ms
    index_keys = {ticket.token.ticket_id: [keys.ticket_owner(ticket.token.ticket_id)]
                  for ticket in (released, aborted)}
    if not isinstance(backend.client, RedisCluster):  # there written off the open's path
        for ticket_id, keys_of in index_keys.items():
            keys_of.append(keys.legacy_ticket_owner(ticket_id))
    for keys_of in index_keys.values():
        for key in keys_of:
            assert await backend.client.pttl(key) > 2 * backstop_ms, key
    await backend.tickets.release(released.token)
    await backend.tickets.transition(aborted.token, TicketState.ABORTED, "test")
    await backend.tickets.finish_background_writes()
    for keys_of in index_keys.values():
        for key in keys_of:
            assert 0 < await backend.client.pttl(key) <= backstop_ms, key
    assert await backend.tickets.find(released.token.ticket_id) is not None


async def test_a_ticket_an_earlier_release_indexed_is_found(harness: Harness) -> None:
    """Earlier releases kept only the unslotted id index: a replica of this release finds their
    tickets through it (a fleet mid-upgrade)."""
    backend = harness.backend
    if not isinstance(backend, RedisStateBackend):
        pytest.skip("the id index is Redis's")
    await backend.tickets.set_capacity("d1", 16)
    ticket = await backend.tickets.open(spec())
    keys, ticket_id = backend.keys, ticket.token.ticket_id
    assert await backend.client.get(keys.legacy_ticket_owner(ticket_id)) == "d1" or isinstance(
        backend.client, RedisCluster)  # written off the open's path there
    await backend.client.delete(keys.ticket_owner(ticket_id))
    await backend.client.set(keys.legacy_ticket_owner(ticket_id), "d1")
    other = open_backend(harness.url, harness.clock, harness.options)
    try:
        assert await other.tickets.get(ticket.token) == ticket
    finally:
        await other.close()


async def test_reconcile_releases_what_the_worker_does_not_hold(harness: Harness) -> None:
    tickets, clock = harness.backend.tickets, harness.clock
    await tickets.set_capacity("d1", 32)
    old_held = await tickets.mark_held((await ticket_in(harness.backend, TicketState.DONE)).token)
    old_gone = await tickets.mark_held((await ticket_in(harness.backend, TicketState.DONE)).token)
    old_reserved = await ticket_in(harness.backend, TicketState.PREFILLING)
    await tickets.extend(old_reserved.token, 100.0)
    clock.advance(GRACE_S + 1)
    young = await tickets.open(spec())  # the report may predate it
    report = BlockReport("d1", 40, {str(old_held.token): 4})
    result = await tickets.reconcile(report)
    assert set(result.released) == {str(old_gone.token), str(old_reserved.token)}
    assert result.adopted == ()
    assert (result.snapshot.num_total_blocks, result.snapshot.num_reserved_blocks,
            result.snapshot.num_held_blocks) == (40, 4, 4)
    assert result.snapshot == await tickets.snapshot("d1")
    assert (await tickets.get(old_reserved.token)).state is TicketState.ABORTED
    with pytest.raises(StaleTokenError):
        await tickets.release(old_gone.token)
    assert (await tickets.get(young.token)).state is TicketState.OPEN
    again = await tickets.reconcile(report)  # nothing left to change
    assert (again.released, again.adopted, again.snapshot) == ((), (), result.snapshot)


async def test_reconcile_after_a_store_loss_adopts_held_sequences(harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 32)
    held = await tickets.mark_held((await ticket_in(harness.backend, TicketState.DONE, 6)).token)
    in_flight = await ticket_in(harness.backend, TicketState.TRANSFERRING)
    freed = await ticket_in(harness.backend, TicketState.ABORTED)

    tickets = (await harness.lose_state()).tickets
    for token in (held.token, in_flight.token, freed.token):
        with pytest.raises(StaleTokenError):
            await tickets.get(token)
    with pytest.raises(StaleTokenError):
        await tickets.transition(in_flight.token, TicketState.DONE)
    with pytest.raises(NotFoundError):
        await tickets.snapshot("d1")

    result = await tickets.reconcile(BlockReport("d1", 32, {str(held.token): 6}))
    assert result.adopted == (str(held.token),)
    assert result.released == ()
    assert (result.snapshot.num_total_blocks, result.snapshot.num_held_blocks) == (32, 6)
    adopted = await tickets.get(held.token)
    assert (adopted.state, adopted.is_held, adopted.num_blocks) == (TicketState.DONE, True, 6)
    await tickets.set_capacity("d1", 32)  # the heartbeat path after reconcile changes nothing
    assert await used_blocks(harness.backend) == (0, 6)
    with pytest.raises(StaleTokenError):  # a lost in-flight ticket never comes back
        await tickets.get(in_flight.token)
    await tickets.release(held.token)  # the sequence ends: its blocks come back once
    with pytest.raises(StaleTokenError):
        await tickets.release(held.token)
    assert await used_blocks(harness.backend) == (0, 0)


async def test_reconcile_never_revives_a_freed_ticket_and_names_it_stale(
        harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    expired = await ticket_in(harness.backend, TicketState.EXPIRED)
    result = await tickets.reconcile(BlockReport("d1", 16, {str(expired.token): 4}))
    assert (result.adopted, result.released) == ((), ())
    assert result.stale == (str(expired.token),)  # the worker missed its DropTicket
    assert await used_blocks(harness.backend) == (0, 0)
    other_attempt = FencingToken(expired.token.ticket_id, 2)
    result = await tickets.reconcile(BlockReport("d1", 16, {str(other_attempt): 4}))
    assert result.adopted == () and await used_blocks(harness.backend) == (0, 0)
    assert result.stale == (str(other_attempt),)


async def test_reconcile_names_stale_only_what_the_ledger_does_not_hold_for_the_worker(
        harness: Harness) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 32)
    live = await ticket_in(harness.backend, TicketState.PREFILLING)
    held = await tickets.mark_held((await ticket_in(harness.backend, TicketState.DONE)).token)
    older_attempt = FencingToken(live.token.ticket_id, live.token.attempt + 1)
    report = {str(held.token): 4, str(older_attempt): 4}
    result = await tickets.reconcile(BlockReport("d1", 32, report))
    assert result.stale == (str(older_attempt),)  # the ledger's ticket is at another attempt
    assert result.released == ()  # the live ticket is younger than the grace: kept
    assert (await tickets.get(live.token)).state is TicketState.PREFILLING
    result = await tickets.reconcile(BlockReport("d1", 32, {str(held.token): 4,
                                                            str(live.token): 4}))
    assert result.stale == ()


@pytest.mark.parametrize(
    "blocks_by_token",
    [{"not-a-token": 1}, {"abc#x": 1}, {"abc#1": 0}, {"abc#1": 10, "def#1": 7}],
)
async def test_reconcile_refuses_a_malformed_report(
    harness: Harness, blocks_by_token: dict[str, int]
) -> None:
    tickets = harness.backend.tickets
    await tickets.set_capacity("d1", 16)
    with pytest.raises(InvalidArgumentError):
        await tickets.reconcile(BlockReport("d1", 16, blocks_by_token))
    assert await used_blocks(harness.backend) == (0, 0)


# -- workers --------------------------------------------------------------------------------


def worker(
    worker_id: str, role: WorkerRole = WorkerRole.DECODE, deployment: str = "llama"
) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, deployment=deployment, role=role, state=WorkerState.LOADING,
        address=f"{worker_id}:50051", kv_address=f"{worker_id}:50052",
        load=WorkerLoad(0, 0, 100, 100), last_heartbeat_s=1.5, registered_s=1.25,
        spec=f"description of {worker_id}".encode() + bytes([0, 255, 10]),  # opaque, not text
    )


async def test_workers_are_stored_listed_and_updated(harness: Harness) -> None:
    workers, clock = harness.backend.workers, harness.clock
    d1, d2, p1 = worker("d1"), worker("d2"), worker("p1", WorkerRole.PREFILL)
    other = worker("q1", deployment="qwen")
    for record in (d2, p1, d1, other):
        await workers.upsert(record, ttl_s=30.0)
    assert await workers.get("d1") == d1
    assert await workers.get("nobody") is None
    assert await workers.list() == [d1, d2, p1, other]
    assert await workers.list("llama") == [d1, d2, p1]
    assert await workers.list("llama", WorkerRole.DECODE) == [d1, d2]
    assert await workers.list(role=WorkerRole.PREFILL) == [p1]
    assert await workers.list("nothing") == []

    clock.advance(10.0)
    load = WorkerLoad(num_queued_prefill_tokens=7, num_running_seqs=3, num_free_blocks=40,
                      num_total_blocks=100)
    beat = await workers.heartbeat("d1", load, ttl_s=30.0)
    assert (beat.load, beat.last_heartbeat_s, beat.address) == (load, clock(), d1.address)
    ready = await workers.set_state("d1", WorkerState.READY)
    assert (ready.state, ready.load) == (WorkerState.READY, load)
    assert await workers.get("d1") == ready

    moved = worker("d2", WorkerRole.PREFILL)
    await workers.upsert(moved, ttl_s=30.0)
    assert await workers.list("llama", WorkerRole.DECODE) == [ready]
    assert await workers.list("llama", WorkerRole.PREFILL) == [moved, p1]
    await workers.remove("p1")
    await workers.remove("p1")
    assert await workers.get("p1") is None
    assert await workers.list("llama") == [ready, moved]


async def test_worker_records_expire_with_their_ttl(harness: Harness) -> None:
    workers, clock = harness.backend.workers, harness.clock
    await workers.upsert(worker("d1"), ttl_s=10.0)
    await workers.upsert(worker("d2"), ttl_s=10.0)
    clock.advance(9.0)
    await workers.heartbeat("d2", WorkerLoad(), ttl_s=10.0)
    clock.advance(1.0)
    assert await workers.get("d1") is None
    assert [w.worker_id for w in await workers.list()] == ["d2"]
    with pytest.raises(NotFoundError):
        await workers.heartbeat("d1", WorkerLoad(), ttl_s=10.0)
    with pytest.raises(NotFoundError):
        await workers.set_state("d1", WorkerState.READY)
    with pytest.raises(InvalidArgumentError):
        await workers.upsert(worker("d3"), ttl_s=0.0)
    await workers.upsert(worker("d1"), ttl_s=10.0)  # re-register
    assert [w.worker_id for w in await workers.list()] == ["d1", "d2"]


# -- change stream --------------------------------------------------------------------------


def upserted(worker_id: str) -> PoolEvent:
    return PoolEvent(cursor="", kind=PoolEventKind.UPSERTED, deployment="llama",
                     worker=worker(worker_id), worker_id=worker_id)


async def test_change_stream_follows_from_a_snapshot(harness: Harness) -> None:
    backend = harness.backend
    await backend.workers.upsert(worker("d1"), ttl_s=30.0)
    snapshot = await backend.events.snapshot("llama", backend.workers)
    assert snapshot.workers == (worker("d1"),)
    empty = await backend.events.read("llama", snapshot.cursor)
    assert (empty.events, empty.cursor, empty.is_gap) == ((), snapshot.cursor, False)

    cursors = [await backend.events.publish(upserted(f"d{i}")) for i in range(3)]
    removed = PoolEvent(cursor="", kind=PoolEventKind.REMOVED, deployment="llama", worker_id="d0")
    cursors.append(await backend.events.publish(removed))
    assert len(set(cursors)) == 4
    await backend.events.publish(PoolEvent(cursor="", kind=PoolEventKind.TARGET, deployment="qwen"))
    read = await backend.events.read("llama", snapshot.cursor)
    assert not read.is_gap
    assert [e.cursor for e in read.events] == cursors
    assert read.cursor == cursors[-1]
    assert [e.worker for e in read.events[:3]] == [worker(f"d{i}") for i in range(3)]
    assert (read.events[3].kind, read.events[3].worker, read.events[3].worker_id) == (
        PoolEventKind.REMOVED, None, "d0",
    )
    partial = await backend.events.read("llama", cursors[1])
    assert [e.cursor for e in partial.events] == cursors[2:]
    assert (await backend.events.read("llama", read.cursor)).events == ()


async def test_change_stream_read_waits_for_the_next_event(harness: Harness) -> None:
    events = harness.backend.events
    cursor = await events.publish(upserted("d1"))
    nothing = await events.read("llama", cursor, timeout_s=0.05)
    assert (nothing.events, nothing.cursor, nothing.is_gap) == ((), cursor, False)
    reader = asyncio.create_task(events.read("llama", cursor, timeout_s=10.0))
    await asyncio.sleep(0.05)
    published = await events.publish(upserted("d2"))
    woken = await asyncio.wait_for(reader, 10.0)
    assert [e.cursor for e in woken.events] == [published]


async def test_change_stream_reports_a_gap_after_trimming(harness: Harness) -> None:
    events, workers = harness.backend.events, harness.backend.workers
    first = await events.publish(upserted("d1"))
    for _ in range(100):  # Redis trims approximately: whole stream nodes (100 entries by default)
        for i in range(10 * STREAM_MAX_LEN):
            await events.publish(upserted(f"d{i}"))
        gap = await events.read("llama", first)
        if gap.is_gap:
            break
    assert gap.is_gap and gap.events == ()
    snapshot = await events.snapshot("llama", workers)
    after = await events.read("llama", snapshot.cursor)
    assert (after.events, after.is_gap) == ((), False)
    last = await events.publish(upserted("d-last"))
    assert [e.cursor for e in (await events.read("llama", snapshot.cursor)).events] == [last]


async def test_change_stream_reports_a_gap_after_a_store_loss(harness: Harness) -> None:
    cursor = await harness.backend.events.publish(upserted("d1"))
    backend = await harness.lose_state()
    assert (await backend.events.read("llama", cursor)).is_gap
    await backend.events.publish(upserted("d2"))
    await backend.events.publish(upserted("d3"))  # the new stream is further along than before
    assert (await backend.events.read("llama", cursor)).is_gap
    snapshot = await backend.events.snapshot("llama", backend.workers)
    assert not (await backend.events.read("llama", snapshot.cursor)).is_gap


async def test_change_stream_cursor_forms(harness: Harness) -> None:
    events = harness.backend.events
    assert (await events.read("llama", "")).is_gap  # never read: start from a snapshot
    with pytest.raises(InvalidArgumentError):
        await events.read("llama", "no-colon")
    cursor = await events.publish(upserted("d1"))
    epoch = cursor.rpartition(":")[0]
    assert (await events.read("llama", f"{epoch}:99")).is_gap  # ahead of the stream
    assert (await events.read("llama", f"{epoch}:0")).events[0].cursor == cursor
    with pytest.raises(InvalidArgumentError):
        await events.publish(PoolEvent(cursor="", kind=PoolEventKind.TARGET, deployment=""))


# -- targets and lifecycle --------------------------------------------------------------------


async def test_targets(harness: Harness) -> None:
    targets = harness.backend.targets
    assert await targets.get_target("llama", WorkerRole.DECODE) is None
    await targets.set_target("llama", WorkerRole.DECODE, 8)
    await targets.set_target("llama", WorkerRole.PREFILL, 3)
    await targets.set_target("llama", WorkerRole.DECODE, 0)
    assert await targets.get_target("llama", WorkerRole.DECODE) == 0
    assert await targets.get_target("llama", WorkerRole.PREFILL) == 3
    assert await targets.get_target("qwen", WorkerRole.PREFILL) is None
    with pytest.raises(InvalidArgumentError):
        await targets.set_target("llama", WorkerRole.DECODE, -1)
    assert await harness.backend.ping()


async def test_published_thresholds_are_versioned_per_deployment(
        harness: Harness) -> None:
    store, clock = harness.backend.thresholds, harness.clock
    assert await store.get("llama") is None and await store.list() == {}
    first = await store.publish("llama", 64, ThresholdSource.COMPUTED)
    assert (first.threshold_tokens, first.source, first.version) == (64, "computed", 1)
    assert first.published_s == clock()
    clock.advance(5.0)
    second = await store.publish("llama", 512, ThresholdSource.PINNED)
    await store.publish("qwen:7b", 0, ThresholdSource.COMPUTED)  # a colon in the name
    assert second.version == 2 and second.published_s == clock()
    assert await store.get("llama") == second
    listed = await store.list()
    assert set(listed) == {"llama", "qwen:7b"} and listed["llama"] == second
    assert listed["qwen:7b"].threshold_tokens == 0 and listed["qwen:7b"].version == 1
    await store.clear("llama")
    assert await store.get("llama") is None and set(await store.list()) == {"qwen:7b"}
    again = await store.publish("llama", 32, ThresholdSource.COMPUTED)
    assert again.version == 3  # a clear keeps the count: a router never sees a version twice
    with pytest.raises(InvalidArgumentError):
        await store.publish("llama", -1, ThresholdSource.COMPUTED)
    with pytest.raises(InvalidArgumentError):
        await store.publish("", 8, ThresholdSource.COMPUTED)
    await harness.lose_state()
    assert await harness.backend.thresholds.list() == {}


# -- tokenizer bundles ------------------------------------------------------------------------


def bundle(name: str = "a") -> TokenizerBundle:
    return TokenizerBundle(
        tokenizer_json=json.dumps({"model": name, "text": "héllo 🙂"}).encode(),
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        bos_token="<s>", eos_token="</s>", pad_token="", max_model_len=4096)


async def test_tokenizer_bundles_are_stored_by_digest(harness: Harness) -> None:
    store = harness.backend.tokenizers
    first, second = bundle("a"), bundle("b")
    assert await store.get(first.sha256) is None
    assert not await store.touch(first.sha256, ttl_s=30.0)
    await store.put(first, ttl_s=30.0)
    await store.put(second, ttl_s=30.0)
    got = await store.get(first.sha256)
    assert got == first and got is not None and got.sha256 == first.sha256
    assert await store.get(second.sha256) == second
    await store.put(first, ttl_s=30.0)  # a second worker of the same model: same entry
    assert await store.get(first.sha256) == first
    with pytest.raises(InvalidArgumentError):
        await store.get("")
    with pytest.raises(InvalidArgumentError):
        await store.put(first, ttl_s=0.0)


async def test_tokenizer_bundles_expire_unless_touched(harness: Harness) -> None:
    store, clock = harness.backend.tokenizers, harness.clock
    kept, dropped = bundle("kept"), bundle("dropped")
    await store.put(kept, ttl_s=10.0)
    await store.put(dropped, ttl_s=10.0)
    clock.advance(9.0)
    assert await store.touch(kept.sha256, ttl_s=10.0)
    clock.advance(1.0)
    assert await store.get(dropped.sha256) is None
    assert not await store.touch(dropped.sha256, ttl_s=10.0)  # never revives it
    assert await store.get(dropped.sha256) is None
    assert await store.get(kept.sha256) == kept
    clock.advance(10.0)
    assert await store.get(kept.sha256) is None


async def test_tokenizer_bundles_are_lost_with_the_store(harness: Harness) -> None:
    await harness.backend.tokenizers.put(bundle(), ttl_s=30.0)
    backend = await harness.lose_state()
    assert await backend.tokenizers.get(bundle().sha256) is None
    assert not await backend.tokenizers.touch(bundle().sha256, ttl_s=30.0)


def test_keys_one_script_touches_share_a_cluster_slot() -> None:
    keys = RedisKeys("pdserve")
    for worker_id in ("d1", "decode-7:gpu0", "a{b}c"):
        ticket_keys = [*keys.ledger_keys(worker_id), keys.ticket(worker_id, str(uuid.uuid4()))]
        assert len({key_slot(k.encode()) for k in ticket_keys}) == 1
        assert all(k.startswith("pdserve:") for k in ticket_keys)
    stream_keys = [keys.events_meta("llama"), keys.events_stream("llama")]
    assert len({key_slot(k.encode()) for k in stream_keys}) == 1


def test_open_backend_picks_by_scheme() -> None:
    from pdserve.common.errors import ConfigError
    from pdserve.state.memory.backend import MemoryStateBackend

    clock = StepClock()
    assert isinstance(open_backend(None, clock), MemoryStateBackend)
    assert isinstance(open_backend("memory://", clock), MemoryStateBackend)
    assert isinstance(open_backend("redis://127.0.0.1:1/0", clock), RedisStateBackend)
    cluster = open_backend("redis+cluster://127.0.0.1:1,127.0.0.1:2", clock)
    assert isinstance(cluster, RedisStateBackend) and isinstance(cluster.client, RedisCluster)
    sentinel = open_backend("redis+sentinel://127.0.0.1:1/mymaster/2?replica_acks=1", clock)
    assert isinstance(sentinel, RedisStateBackend)
    assert sentinel.client.connection_pool.service_name == "mymaster"
    with pytest.raises(ConfigError, match="replica_acks"):
        open_backend("redis+cluster://127.0.0.1:1", clock, StateOptions(replica_acks=1))
    with pytest.raises(ConfigError, match="PDSERVE_REDIS_URL"):
        open_backend("redis+sentinel://127.0.0.1:1", clock)
    with pytest.raises(ConfigError):
        open_backend("postgres://x", clock)
    with pytest.raises(ConfigError):
        StateOptions(key_prefix="a{b")


def test_redis_ledger_matches_its_model(redis_url: str) -> None:
    """Random call sequences on Redis, every outcome predicted by a plain model."""

    class RedisLedgerMachine(LedgerModelMachine):
        state_url = redis_url

    run_state_machine_as_test(
        RedisLedgerMachine,
        settings=settings(max_examples=100, stateful_step_count=40, deadline=None),
    )
