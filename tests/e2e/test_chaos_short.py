"""The chaos harness (``bench/chaos.py``), shortened for CI: the same stack of real processes
(two routers, two coordinators, two pool managers per role, two prefill and two decode sim
workers, one of each with its clock an hour off; a private Redis) under steady open-loop load,
with a handful of faults one after another: kill -9 of a prefill worker caught sending KV, of a
decode worker caught decoding, of a router replica, and a Redis restart. Killed processes are
restarted after a delay, as a supervisor would.

Asserted, as ``bench/chaos.py`` reports them: no request hung, was cut short or failed (a failure
before the first token is retried on other workers, a stream whose decode worker was killed
fails over to another, one whose router replica was killed is resumed by its client on the other
replica); after settling, ``pdserve
audit`` finds every ledger exact, the KV checksums of every handoff seen agree on both sides,
no block is left in use and no ticket open, and no late KV frame was accepted; after the Redis
restart serving resumed without restarting any process.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import ServiceProcess

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from _chaos_faults import ChaosPlan, ChaosResult, has_problems, run_chaos, save_logs
from _chaos_load import Counts
from _chaos_stack import ChaosConfig, ChaosStack

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CONFIG = ChaosConfig(num_governors=0, is_private_postgres=False)
"""The governor's failover has its own test (test_faults_governor); Postgres stays up."""
PLAN = ChaosPlan(
    rate_rps=4.0,
    faults=("kill_prefill_sending", "kill_decode_decoding", "kill_router", "redis_restart"),
    min_accepted=150, max_duration_s=90.0, postgres_down_s=0.0, scale_down_hold_s=0.0,
    gap_s=(0.5, 2.0), restart_delay_s=(0.5, 1.5), seed=3,
)


@pytest.fixture(scope="module")
def chaos_stack(e2e_database_url: str, processes: list[ServiceProcess],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosStack]:
    work_dir = tmp_path_factory.mktemp("chaos")
    stack = ChaosStack(CONFIG, work_dir, processes)
    try:
        yield stack.start(database_url=e2e_database_url)
    finally:
        stack.close()


@pytest.fixture(scope="module")
def result(chaos_stack: ChaosStack) -> ChaosResult:
    result = asyncio.run(run_chaos(chaos_stack, PLAN))
    counts = result.counts
    print(f"chaos (short): {counts}")
    for fault in result.faults:
        print(f"  {fault.name}: {fault.victim} recovered after {fault.recovery_s:.1f}s "
              f"{fault.details} {fault.error}")
    if has_problems(result):  # every process's output, for whoever reads the failure
        print(f"process logs: {save_logs(chaos_stack, str(chaos_stack.work_dir / 'logs'))}")
    return result


def test_every_fault_was_injected_and_recovered_from(result: ChaosResult) -> None:
    # Every fault at least once (the run goes on with more until enough requests were accepted).
    assert {f.name for f in result.faults} == set(PLAN.faults)
    problems = {f.name: f.error for f in result.faults if f.error}
    assert not problems, problems
    redis = result.fault("redis_restart")
    assert redis is not None and "first_success_s" in redis.details, redis


def test_no_request_hung_or_was_truncated_and_failures_are_clean(result: ChaosResult) -> None:
    counts: Counts = result.counts
    assert counts.accepted >= PLAN.min_accepted, counts  # the load ran until there were enough
    assert counts.hung == 0, counts
    assert counts.truncated == 0, counts
    assert counts.duplicated == 0, counts
    assert counts.client_errors == 0, [o for o in result.outcomes if o.kind == "client_error"][:3]
    assert counts.completed + counts.failed_clean == counts.accepted, counts
    # Nothing fails: anything before the first token is retried on other workers, and a stream
    # cut later by a decode worker's or router's death goes on (failover, client resume).
    assert not result.unexpected_failures, result.unexpected_failures[:5]
    assert not result.expected_failures, result.expected_failures[:5]
    assert counts.failed_clean == 0, counts


def test_after_settling_no_block_leaked_no_ticket_left_and_no_late_write_landed(
    result: ChaosResult,
) -> None:
    assert result.audit is not None
    assert result.audit.is_ok, str(result.audit)
    # Handoff checksums gathered through the run (killed workers' included): sent == accepted.
    assert result.num_checksums_compared > 0
    assert not result.checksum_mismatches, result.checksum_mismatches[:5]
    assert not result.orphaned_tickets, result.orphaned_tickets[:5]
    assert not result.idle_ledger_problems, result.idle_ledger_problems
    assert result.leaked_blocks == 0
    assert result.late_writes_accepted == 0


def test_only_the_killed_processes_were_restarted(result: ChaosResult,
                                                  chaos_stack: ChaosStack) -> None:
    # Redis came back empty and nothing was restarted for it: every process is either running
    # or one of the victims (each replaced by a restart of the same command).
    victims = {f.victim.split(" ")[0] for f in result.faults if f.name.startswith("kill_")}
    dead = {p.name for p in chaos_stack.processes if p.returncode is not None}
    assert dead <= victims, (dead, victims)
    running = {p.name for p in chaos_stack.processes if p.returncode is None}
    assert victims <= running  # restarted
