"""The hot state on highly available Redis: a real Redis Cluster (3 masters + 3 replicas) and a
real Sentinel set-up (master, replica, three sentinels), each private to this module on free
ports. The store contract itself runs on both in ``test_state_contract.py``; here: keys spread
over every master, and a failover under a stream of ticket requests loses none of them.

A "request" is what the coordinator does for one generation: open a ticket, move it to
PREFILLING, and (for half of them) release it. A step that fails with ``UnavailableError`` is
retried, as callers do; a retried step whose first try may have run is checked by reading the
ticket back. Afterwards every acknowledged step must be in the store, exactly once, and each
decode worker's ledger must count exactly the blocks of its live tickets.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import pytest
from helpers import StepClock
from helpers.private_redis_ha import (
    PrivateRedisCluster,
    PrivateSentinel,
    private_redis_cluster,
    private_sentinel,
)

from pdserve.common.errors import PdserveError, UnavailableError
from pdserve.common.leadership import open_lease
from pdserve.common.types import FencingToken, Ticket, TicketSpec, TicketState, WorkerRole
from pdserve.kv_transfer.rendezvous import open_rendezvous
from pdserve.state.expert_loads import ExpertLoadReport, expert_load_store_for
from pdserve.state.factory import StateOptions, open_backend
from pdserve.state.redis.backend import RedisStateBackend
from pdserve.state.stores import open_stores

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

T = TypeVar("T")

NUM_WORKERS = 6
NUM_BLOCKS_PER_WORKER = 100_000
NUM_CONCURRENT = 8
RETRY_BUDGET_S = 60.0
"""How long a request's step is retried through a failover (Sentinel: until the old master has
rejoined as a replica, see ``SENTINEL_REPLICA_ACKS``)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateRedisCluster]:
    with private_redis_cluster() as server:
        yield server


@pytest.fixture(scope="module")
def sentinel() -> Iterator[PrivateSentinel]:
    with private_sentinel() as server:
        yield server


def _options() -> StateOptions:
    return StateOptions(key_prefix=f"pdtest-{uuid.uuid4().hex[:12]}")


async def test_keys_of_many_tickets_spread_over_every_master(cluster: PrivateRedisCluster) -> None:
    backend = open_backend(cluster.url, StepClock(), _options())
    assert isinstance(backend, RedisStateBackend)
    try:
        for n in range(24):
            await backend.tickets.set_capacity(f"d{n}", 64)
            for _ in range(3):
                await backend.tickets.open(_spec(f"d{n}", f"r{n}"))
        prefix = backend.keys.prefix
        keys_by_master = {}
        for node in backend.client.get_primaries():
            keys_by_master[node.name] = [
                key async for key in backend.client.scan_iter(
                    match=f"{prefix}:*", target_nodes=node)]
        assert len(keys_by_master) == 3
        assert all(len(keys) > 10 for keys in keys_by_master.values()), {
            name: len(keys) for name, keys in keys_by_master.items()}
        # One worker's ledger and tickets (what one script touches) live on one master.
        for n in range(24):
            tagged = [k for keys in keys_by_master.values() for k in keys if f"{{w:d{n}}}" in k]
            assert len(tagged) == 3 + 3  # ledger, leases, ticket index + 3 tickets
            assert len({backend.client.keyslot(k) for k in tagged}) == 1
    finally:
        await backend.close()


async def test_the_keys_beside_the_backend_work_on_the_cluster(
        cluster: PrivateRedisCluster) -> None:
    """What services keep next to the backend on the same URL: the prefix index, the
    coordinator's rendezvous (pub/sub), leadership leases, expert-load queues."""
    stores = open_stores(cluster.url, time.time)
    try:
        index = stores.prefix_index
        await index.update("llama", "p1", added=[1, 2, 3], removed=[])
        await index.update("llama", "p2", added=[1], removed=[])
        assert await index.overlap("llama", ["p1", "p2", "p3"], [1, 2, 4]) == {
            "p1": 2, "p2": 1, "p3": 0}

        rendezvous = open_rendezvous(stores.redis_client)
        token = FencingToken.new()
        waiter = asyncio.create_task(rendezvous.wait(token, timeout_s=20.0))
        await asyncio.sleep(0.2)
        await rendezvous.publish(token, b"where the layers go", ttl_s=30.0)
        assert await waiter == b"where the layers go"

        lease = open_lease(stores.redis_client, f"test-{uuid.uuid4().hex[:8]}", "holder-a")
        rival = open_lease(stores.redis_client, lease.name, "holder-b")
        fencing = await lease.acquire(ttl_s=30.0)
        assert fencing is not None and await rival.acquire(ttl_s=30.0) is None
        assert await lease.renew(fencing, ttl_s=30.0)
        await lease.release(fencing)
        assert await rival.acquire(ttl_s=30.0) is not None

        experts = expert_load_store_for(stores.backend)
        report = ExpertLoadReport("d1", 1, np.array([3, 0, 5]))
        await experts.append("llama", WorkerRole.DECODE, report)
        drained = await experts.drain("llama", WorkerRole.DECODE)
        assert [r.token_counts.tolist() for r in drained] == [[3, 0, 5]]
        assert ("llama", WorkerRole.DECODE) in await experts.pools()
    finally:
        await stores.close()


async def test_a_cluster_failover_under_load_loses_no_request(
        cluster: PrivateRedisCluster) -> None:
    async def fail_over() -> None:
        master = cluster.master_ports()[0]
        await asyncio.to_thread(cluster.fail_over, master)

    load = await _run_load(cluster.url, fail_over)
    await _assert_nothing_lost(cluster.url, load)
    await asyncio.to_thread(_wait_healthy, cluster)


async def test_a_sentinel_failover_under_load_loses_no_request(sentinel: PrivateSentinel) -> None:
    old_master = sentinel.master_port()

    async def fail_over() -> None:
        await asyncio.to_thread(sentinel.fail_over)

    load = await _run_load(sentinel.url, fail_over)
    assert sentinel.master_port() != old_master
    await _assert_nothing_lost(sentinel.url, load)


# -- the load -------------------------------------------------------------------------------


def _spec(worker_id: str, request_id: str, num_blocks: int = 2) -> TicketSpec:
    return TicketSpec(deployment="llama", decode_worker_id=worker_id, prefill_worker_id="p1",
                      num_blocks=num_blocks, lease_s=600.0, request_id=request_id,
                      num_prompt_tokens=32)


@dataclass
class Load:
    options: StateOptions
    live: dict[str, Ticket] = field(default_factory=dict)
    """Request id -> its acknowledged ticket, for requests that keep it (PREFILLING)."""
    released: dict[str, Ticket] = field(default_factory=dict)
    """Request id -> its ticket, acknowledged as released."""
    unsure_request_ids: set[str] = field(default_factory=set)
    """Requests with an open whose outcome is unknown (it may have made a ticket)."""
    num_unavailable: int = 0
    num_before: int = 0
    num_after: int = 0


async def _retried(load: Load, step: Callable[[], Awaitable[T]],
                   settled: Callable[[], Awaitable[T | None]] | None = None) -> T:
    """``step`` until it is acknowledged; after an unknown outcome, ``settled`` (if given) says
    whether the earlier try already did it (its result, or None)."""
    deadline = time.monotonic() + RETRY_BUDGET_S
    was_unsure = False
    while True:
        try:
            return await step()
        except UnavailableError:
            load.num_unavailable += 1
            was_unsure = True
        except PdserveError:
            if not (was_unsure and settled is not None):
                raise
            result = await settled()
            if result is None:
                raise
            return result
        assert time.monotonic() < deadline, "a step stayed unavailable past the retry budget"
        await asyncio.sleep(0.05)


async def _request(backend: RedisStateBackend, load: Load, number: int) -> None:
    request_id = f"req-{number}"
    worker_id = f"d{number % NUM_WORKERS}"
    attempts = itertools.count()

    async def open_ticket() -> Ticket:
        if next(attempts) > 0:
            load.unsure_request_ids.add(request_id)
        return await backend.tickets.open(_spec(worker_id, request_id))

    ticket = await _retried(load, open_ticket)

    async def state_is(state: TicketState) -> Ticket | None:
        found = await backend.tickets.get(ticket.token)
        return found if found.state is state else None

    ticket = await _retried(
        load, lambda: backend.tickets.transition(ticket.token, TicketState.PREFILLING),
        lambda: state_is(TicketState.PREFILLING))
    if number % 2:
        load.live[request_id] = ticket
        return
    ticket = await _retried(load, lambda: backend.tickets.release(ticket.token),
                            lambda: state_is(TicketState.ABORTED))
    load.released[request_id] = ticket


async def _run_load(url: str, fail_over: Callable[[], Awaitable[None]]) -> Load:
    """Requests from ``NUM_CONCURRENT`` tasks before, during and after ``fail_over``."""
    load = Load(_options())
    backend = open_backend(url, time.time, load.options)
    assert isinstance(backend, RedisStateBackend)
    numbers = itertools.count()
    is_failing_over = asyncio.Event()
    is_done = asyncio.Event()

    async def worker() -> None:
        while not is_done.is_set():
            await _request(backend, load, next(numbers))
            if not is_failing_over.is_set():
                load.num_before += 1

    try:
        for n in range(NUM_WORKERS):
            await backend.tickets.set_capacity(f"d{n}", NUM_BLOCKS_PER_WORKER)
        tasks = [asyncio.create_task(worker()) for _ in range(NUM_CONCURRENT)]
        await asyncio.sleep(1.0)
        is_failing_over.set()
        await fail_over()
        num_at_failover = len(load.live) + len(load.released)
        await asyncio.sleep(1.0)
        is_done.set()
        await asyncio.gather(*tasks)
        load.num_after = len(load.live) + len(load.released) - num_at_failover
    finally:
        await backend.close()
    print(f"failover under load: {load.num_before} requests before, {load.num_after} after, "
          f"{load.num_unavailable} unavailable replies retried, "
          f"{len(load.unsure_request_ids)} opens of unknown outcome")
    return load


async def _assert_nothing_lost(url: str, load: Load) -> None:
    assert load.num_before > 0 and load.num_after > 0, (load.num_before, load.num_after)
    backend = open_backend(url, time.time, load.options)  # a fresh client: the new topology
    try:
        for request_id, ticket in load.live.items():
            found = await backend.tickets.get(ticket.token)
            assert (found.state, found.request_id) == (TicketState.PREFILLING, request_id)
        for ticket in load.released.values():
            found = await backend.tickets.get(ticket.token)
            assert found.state is TicketState.ABORTED and not found.is_held
        listed = await backend.tickets.list_tickets()
        owning = [t for t in listed if t.state in (TicketState.OPEN, TicketState.PREFILLING)]
        acked_live = {t.token for t in load.live.values()}
        assert acked_live <= {t.token for t in owning}
        # Beyond the acknowledged tickets, only those an unanswered open may have made.
        extra = [t for t in owning if t.token not in acked_live]
        assert all(t.state is TicketState.OPEN for t in extra), extra
        assert {t.request_id for t in extra} <= load.unsure_request_ids, extra
        for n in range(NUM_WORKERS):
            worker_id = f"d{n}"
            snapshot = await backend.tickets.snapshot(worker_id)
            owned = [t for t in owning if t.decode_worker_id == worker_id]
            assert snapshot.num_reserved_blocks == sum(t.num_blocks for t in owned), worker_id
    finally:
        await backend.close()


def _wait_healthy(cluster: PrivateRedisCluster) -> None:
    deadline = time.monotonic() + 30.0
    while not cluster.is_healthy():
        assert time.monotonic() < deadline, "the cluster did not settle after the failover"
        time.sleep(0.1)
