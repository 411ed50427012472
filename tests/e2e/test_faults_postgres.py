"""Postgres down under load, on a private PostgreSQL: serving goes on, durable records wait in
each process's spool on local disk, a coordinator killed with SIGKILL while holding spooled
records loses none (its restart adopts its spool), and when the database returns every record
is written: each remote handoff's transfer statistics and each worker's READY event."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.private_postgres import PrivatePostgres, private_postgres

from pdserve.api.v1 import common_pb2 as pb
from pdserve.api.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from pdserve.common.grpc_client import channel_target
from pdserve.common.types import WorkerState
from pdserve.db.durable import SPOOL_SUFFIX
from pdserve.db.repository import Repository

from .conftest import ServiceProcess, run_cli
from .faults import (
    MODEL,
    Load,
    Stack,
    assert_clean,
    build_stack,
    failure_reasons,
    kill9,
    summary,
    wait_until,
)

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.fixture(scope="module")
def postgres() -> Iterator[PrivatePostgres]:
    with private_postgres() as server:
        result = run_cli(["db", "upgrade", "--database-url", server.url])
        assert result.returncode == 0, result.stdout + result.stderr
        yield server


def _remote_done_ticket_ids(stack: Stack) -> set[str]:
    target, options = channel_target(stack.coordinator_address)
    with grpc.insecure_channel(target, options=options) as channel:
        tickets = kv_transfer_pb2_grpc.KvTransferServiceStub(channel).ListTickets(
            kv_transfer_pb2.ListTicketsRequest(state=pb.TICKET_STATE_DONE, limit=100_000),
            timeout=10).tickets
    return {t.token.ticket_id for t in tickets if t.prefill_worker_id}


async def test_records_spooled_while_postgres_is_down_survive_a_sigkill_and_are_written(
        postgres: PrivatePostgres, e2e_redis_url: str, processes: list[ServiceProcess],
        tmp_path: Path) -> None:
    spool_dir = tmp_path / "spool"
    stack = await asyncio.to_thread(
        build_stack, processes, e2e_redis_url, postgres.url, num_replicas=2,
        extra_env={"PDSERVE_DURABLE_SPOOL_DIR": str(spool_dir)})
    worker_ids = {w.worker_id for w in stack.workers}

    await asyncio.to_thread(postgres.stop)
    try:
        load = Load(stack.router_addresses, concurrency=4, prompt_tokens=(100, 800)).start()
        await asyncio.sleep(3.0)
        done_before_kill = await asyncio.to_thread(_remote_done_ticket_ids, stack)
        spooled = [p for p in spool_dir.rglob(f"*{SPOOL_SUFFIX}") if p.stat().st_size > 0]
        victim = stack.coordinators[0]
        await asyncio.to_thread(kill9, victim)
        await asyncio.sleep(1.0)
        outcomes = await load.stop()
        print(f"postgres down: {summary(outcomes)} {failure_reasons(outcomes)}")
        assert_clean(outcomes, max_failed=0)  # serving does not depend on the database
        assert summary(outcomes)["completed"] > 0
        assert done_before_kill, "no remote handoff finished while the database was down"
        assert spooled, f"nothing was spooled under {spool_dir}"
        stack.coordinators[0] = restarted = stack.restart(victim)
        await asyncio.to_thread(restarted.wait_ready)
    finally:
        await asyncio.to_thread(postgres.start)

    done = await asyncio.to_thread(_remote_done_ticket_ids, stack)
    assert done_before_kill <= done
    repository = Repository.from_url(postgres.url)
    try:
        def stats_ids() -> set[str]:
            return {s.ticket_id for s in repository.list_transfer_stats(MODEL, limit=10_000)}

        def ready_ids() -> set[str]:
            return {e.worker_id for e in repository.list_worker_events(deployment=MODEL,
                                                                       limit=10_000)
                    if e.to_state is WorkerState.READY}

        await asyncio.to_thread(wait_until, lambda: done <= stats_ids(), 30.0, 0.5)
        missing = done - stats_ids()
        assert not missing, (f"{len(missing)} of {len(done)} remote handoffs have no transfer "
                             f"statistics, e.g. {sorted(missing)[:3]}")
        assert await asyncio.to_thread(wait_until, lambda: worker_ids <= ready_ids(), 30.0, 0.5)
        # Each handoff is recorded once, although the killed coordinator's records were replayed.
        rows = await asyncio.to_thread(repository.list_transfer_stats, MODEL, 10_000)
        assert len(rows) == len({(r.ticket_id, r.attempt) for r in rows})
    finally:
        repository.close()
    # Every spool is drained and truncated once its records are in.
    assert await asyncio.to_thread(wait_until, lambda: all(
        p.stat().st_size == 0 for p in spool_dir.rglob(f"*{SPOOL_SUFFIX}")), 30.0, 0.5)
