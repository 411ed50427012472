"""Contract checks that every database behind ``Repository`` must pass, plus a test clock.

The SQLite suite (``tests/unit/test_db_sqlite.py``) and the Postgres suite
(``tests/integration/test_db.py``) run the same ``check_*`` functions, so the two backends cannot
drift apart. Each check starts from an empty, migrated database and raises ``AssertionError``
on a difference. Services may use ``StepClock`` and a SQLite repository in their own tests.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta, timezone

import sqlalchemy as sa

from pdserve.common.errors import AlreadyExistsError, ConfigError
from pdserve.common.types import ThresholdSource, TicketState, WorkerRole, WorkerState
from pdserve.db import migrate
from pdserve.db.records import (
    CapacityPlanRecord,
    DeploymentRecord,
    ExpertPlacementRecord,
    MissReason,
    RequestWindowRecord,
    ScalingAction,
    ScalingDecisionRecord,
    ThresholdDecisionRecord,
    TransferStatsRecord,
    WorkerEventRecord,
)
from pdserve.db.repository import Repository

EPOCH = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


class StepClock:
    """A wall clock for tests: every reading is ``step_s`` later than the previous one."""

    def __init__(self, start: datetime = EPOCH, step_s: float = 1.0) -> None:
        self._next = start
        self._step = timedelta(seconds=step_s)
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            now, self._next = self._next, self._next + self._step
            return now


# Migrations --------------------------------------------------------------------------------

def _pdserve_tables(target: sa.Engine) -> set[str]:
    names = sa.inspect(target).get_table_names()
    return {name for name in names if name.startswith(migrate.TABLE_PREFIX)}


def check_migration_cycle(engine: sa.Engine) -> None:
    """Empty -> head -> head again (no-op) -> base -> head, on a database with no pdserve tables."""
    assert migrate.current(engine) is None
    assert migrate.upgrade(engine) == migrate.head()
    tables = _pdserve_tables(engine)
    assert len(tables) == 9, tables  # eight record tables and the version table
    assert migrate.upgrade(engine) == migrate.head()
    assert _pdserve_tables(engine) == tables
    assert migrate.schema_diff(engine) == []
    assert migrate.downgrade(engine, "base") is None
    assert _pdserve_tables(engine) == {migrate.VERSION_TABLE}
    assert migrate.upgrade(engine, "head") == migrate.head()
    assert _pdserve_tables(engine) == tables
    migrate.check_at_head(engine)


def check_schema_matches_models(engine: sa.Engine) -> None:
    """The hand-written revisions build exactly what the models describe, and the comparison
    notices a change (so an empty diff means something)."""
    migrate.upgrade(engine)
    assert migrate.schema_diff(engine) == []
    with engine.begin() as connection:
        connection.execute(sa.text("DROP INDEX ix_pdserve_transfer_stats_deployment_at"))
    diff = migrate.schema_diff(engine)
    assert [op[0] for op in diff] == ["add_index"], diff
    assert diff[0][1].name == "ix_pdserve_transfer_stats_deployment_at"


def check_old_schema_is_refused(engine: sa.Engine) -> None:
    """A repository on an unmigrated database says to run the upgrade."""
    repo = Repository(engine, clock=StepClock())
    for call in (lambda: repo.latest_capacity_plan("d"), lambda: migrate.check_at_head(engine)):
        try:
            call()
        except ConfigError as error:
            assert "pdserve db upgrade" in error.message, error.message
        else:
            raise AssertionError("expected ConfigError on an unmigrated database")


# Repository round trips --------------------------------------------------------------------

def check_deployments(repo: Repository) -> None:
    first = repo.upsert_deployment(DeploymentRecord(
        name="llama-70b", model="meta-llama/Llama-3.1-70B", gpu="H100-80G", tp_size=4,
        config={"max_model_len": 8192, "slo": {"ttft_ms": 500.0}},
    ))
    assert first.created_at is not None and first.created_at == first.updated_at
    assert repo.get_deployment("llama-70b") == first
    assert repo.get_deployment("missing") is None
    changed = repo.upsert_deployment(DeploymentRecord(
        name="llama-70b", model="meta-llama/Llama-3.1-70B", gpu="H200-141G", tp_size=2,
        config={"max_model_len": 16384},
    ))
    assert (changed.gpu, changed.tp_size, dict(changed.config)) == (
        "H200-141G", 2, {"max_model_len": 16384})
    assert changed.created_at == first.created_at
    assert first.updated_at is not None and changed.updated_at is not None
    assert changed.updated_at > first.updated_at
    other = repo.upsert_deployment(DeploymentRecord(name="dsv3", model="deepseek-ai/DeepSeek-V3",
                                                    gpu="H800-80G", tp_size=8))
    assert repo.list_deployments() == [other, changed]


def check_worker_events(repo: Repository) -> None:
    events = [
        WorkerEventRecord("p-0", "llama", WorkerRole.PREFILL, WorkerState.REGISTERING),
        WorkerEventRecord("p-0", "llama", WorkerRole.PREFILL, WorkerState.LOADING,
                          from_state=WorkerState.REGISTERING),
        WorkerEventRecord("d-0", "llama", WorkerRole.DECODE, WorkerState.FAILED,
                          from_state=WorkerState.READY, reason="no heartbeat for 15 s"),
        WorkerEventRecord("x-0", "other", WorkerRole.DECODE, WorkerState.REGISTERING),
    ]
    stored = [repo.record_worker_event(event) for event in events]
    assert all(s.at is not None for s in stored)
    assert [s.to_state for s in stored] == [e.to_state for e in events]
    assert repo.list_worker_events(deployment="llama") == stored[2::-1]
    assert repo.list_worker_events(worker_id="p-0") == [stored[1], stored[0]]
    assert repo.list_worker_events(deployment="llama", limit=1) == [stored[2]]
    assert repo.list_worker_events(limit=10) == stored[::-1]


def check_scaling_decisions(repo: Repository) -> None:
    stored = [
        repo.record_scaling_decision(ScalingDecisionRecord(
            deployment="llama", role=role, num_current_instances=current,
            num_target_instances=target, action=action, reason=reason, is_dry_run=is_dry_run,
            inputs={"kv_usage": 0.82, "queued_prefill_tokens": [12000, 9000]},
            forecast={"horizon_s": 600, "rps": [10.5, 12.0, None]},
        ))
        for role, current, target, action, reason, is_dry_run in (
            (WorkerRole.PREFILL, 2, 3, ScalingAction.SCALE_UP, "ttft forecast 720 ms", False),
            (WorkerRole.DECODE, 4, 4, ScalingAction.HOLD, "within hysteresis", True),
            (WorkerRole.DECODE, 4, 3, ScalingAction.SCALE_DOWN, "kv usage 31 %", False),
        )
    ]
    repo.record_scaling_decision(ScalingDecisionRecord(
        deployment="other", role=WorkerRole.DECODE, num_current_instances=1,
        num_target_instances=1, action=ScalingAction.HOLD, reason="idle"))
    assert repo.list_scaling_decisions("llama", 10) == stored[::-1]
    assert repo.list_scaling_decisions("llama", 2) == [stored[2], stored[1]]
    assert repo.list_scaling_decisions("llama", 10, role=WorkerRole.PREFILL) == [stored[0]]
    assert repo.list_scaling_decisions("llama", 10)[1].is_dry_run is True
    assert repo.list_scaling_decisions("missing", 10) == []


def check_threshold_decisions(repo: Repository) -> None:
    computed = repo.record_threshold_decision(ThresholdDecisionRecord(
        deployment="llama", threshold_tokens=128, source=ThresholdSource.COMPUTED,
        reason="planner", computed_tokens=128, is_published=True, version=3,
        inputs={"arrival_rate_per_s": 4.5, "prompt_tokens_p50": 180, "num_decode_ready": 2}))
    pinned = repo.record_threshold_decision(ThresholdDecisionRecord(
        deployment="llama", threshold_tokens=512, source=ThresholdSource.PINNED,
        reason="pinned by an operator"))
    repo.record_threshold_decision(ThresholdDecisionRecord(
        deployment="other", threshold_tokens=0, source=ThresholdSource.COMPUTED, reason="x"))
    assert repo.list_threshold_decisions("llama") == [pinned, computed]
    newest = repo.list_threshold_decisions("llama", 1)[0]
    assert newest.source is ThresholdSource.PINNED and newest.computed_tokens is None
    assert newest.version is None and not newest.is_published
    assert repo.list_threshold_decisions("llama")[1].inputs["prompt_tokens_p50"] == 180
    assert repo.list_threshold_decisions("missing") == []


def check_capacity_plans(repo: Repository) -> None:
    assert repo.latest_capacity_plan("llama") is None
    plans = [
        repo.record_capacity_plan(CapacityPlanRecord(
            deployment="llama", num_prefill_instances=num_prefill, num_decode_instances=6,
            predicted_ttft_ms=412.5, predicted_tpot_ms=38.25,
            local_prefill_threshold_tokens=threshold,
            inputs={"rps": 40.0, "slo": {"ttft_ms": 500, "tpot_ms": 50}},
            outputs={"decode_kv_usage": 0.71},
        ))
        for num_prefill, threshold in ((3, 256), (4, 512))
    ]
    repo.record_capacity_plan(CapacityPlanRecord(
        deployment="other", num_prefill_instances=1, num_decode_instances=1,
        predicted_ttft_ms=1.0, predicted_tpot_ms=1.0, local_prefill_threshold_tokens=0,
        inputs={}))
    assert repo.latest_capacity_plan("llama") == plans[1]
    assert plans[1].local_prefill_threshold_tokens == 512


def _window(start: datetime, num_ok: int) -> RequestWindowRecord:
    return RequestWindowRecord(
        deployment="llama", window_start=start, window_s=60.0, num_requests=num_ok + 3,
        num_ok=num_ok, num_ttft_slo_misses=4, num_tpot_slo_misses=2, num_errors=1,
        goodput_rps=(num_ok - 5) / 60.0, ttft_p50_ms=180.0, ttft_p90_ms=420.5, ttft_p99_ms=910.0,
        tpot_p50_ms=31.0, tpot_p90_ms=44.0, tpot_p99_ms=61.5,
        num_misses_by_reason={MissReason.QUEUEING: 3, MissReason.TRANSFER: 1,
                              MissReason.COMPUTE: 2},
    )


def check_request_windows(repo: Repository) -> None:
    starts = [EPOCH + timedelta(minutes=minute) for minute in range(3)]
    stored = [repo.record_request_window(_window(start, 100 + i)) for i, start in
              enumerate(starts)]
    empty = repo.record_request_window(RequestWindowRecord(
        deployment="llama", window_start=EPOCH + timedelta(minutes=3), window_s=60.0,
        num_requests=0, num_ok=0, num_ttft_slo_misses=0, num_tpot_slo_misses=0, num_errors=0,
        goodput_rps=0.0))
    assert repo.list_request_windows("llama") == [empty, *stored[::-1]]
    assert empty.ttft_p99_ms is None
    # Recording a window again replaces it instead of adding a second row.
    replaced = repo.record_request_window(_window(starts[1], 250))
    windows = repo.list_request_windows("llama", since=starts[1])
    assert windows == [empty, stored[2], replaced]
    assert windows[2].num_ok == 250
    assert repo.list_request_windows("llama", limit=1) == [empty]
    assert dict(windows[2].num_misses_by_reason) == {"queueing": 3, "transfer": 1, "compute": 2}


def sample_transfer(ticket_id: str, attempt: int = 1, **overrides: object) -> TransferStatsRecord:
    values: dict[str, object] = {
        "ticket_id": ticket_id, "attempt": attempt, "deployment": "llama",
        "prefill_worker_id": "p-0", "decode_worker_id": "d-0", "num_blocks": 64,
        "num_bytes": 64 * 16 * 20_480, "transfer_s": 0.0412,
        "exposed_s": 0.0031, "prefill_compute_s": 0.187, "outcome": TicketState.DONE,
    }
    values.update(overrides)
    return TransferStatsRecord(**values)  # type: ignore[arg-type]


def check_transfer_stats(repo: Repository) -> None:
    assert repo.record_transfer_stats([]) == 0
    batch = [
        sample_transfer("t-1"),
        sample_transfer("t-1", attempt=2, outcome=TicketState.ABORTED, num_bytes=6 * 2**40),
        sample_transfer("t-2", prefill_worker_id="", outcome=TicketState.EXPIRED),
        sample_transfer("t-2", num_blocks=1),  # same fencing token again in the batch: skipped
    ]
    assert repo.record_transfer_stats(batch) == 3
    assert repo.record_transfer_stats(batch[:2] + [sample_transfer("t-3")]) == 1
    stored = repo.list_transfer_stats("llama")
    assert len(stored) == 4
    by_token = {(s.ticket_id, s.attempt): s for s in stored}
    assert by_token[("t-1", 2)].num_bytes == 6 * 2**40  # beyond 32 bits
    assert by_token[("t-2", 1)].num_blocks == 64 and by_token[("t-2", 1)].prefill_worker_id == ""
    assert by_token[("t-1", 1)] == sample_transfer("t-1", at=by_token[("t-1", 1)].at)
    assert repo.list_transfer_stats("llama", limit=1) == [by_token[("t-3", 1)]]
    many = [sample_transfer(f"bulk-{i}") for i in range(600)]  # more than one insert chunk
    assert repo.record_transfer_stats(many) == 600


def check_expert_placements(repo: Repository) -> None:
    assert repo.latest_expert_placement("dsv3") is None
    placement = {"num_ranks": 4, "physical_to_logical": [[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 2]]}
    first = repo.record_expert_placement(ExpertPlacementRecord("dsv3", placement, 0.91))
    second = repo.record_expert_placement(ExpertPlacementRecord("dsv3", placement, 0.97))
    assert (first.version, second.version) == (1, 2)
    assert repo.latest_expert_placement("dsv3") == second
    assert dict(second.placement) == placement
    try:
        repo.record_expert_placement(ExpertPlacementRecord("dsv3", placement, 0.5, version=2))
    except AlreadyExistsError:
        pass
    else:
        raise AssertionError("a taken placement version must be refused")
    assert repo.latest_expert_placement("dsv3") == second
    other = repo.record_expert_placement(ExpertPlacementRecord("other", {}, 1.0, version=7))
    assert other.version == 7 and repo.latest_expert_placement("dsv3") == second


def check_times_are_utc(repo: Repository) -> None:
    """An aware time in any zone comes back as the same instant, in UTC."""
    tokyo = datetime(2025, 3, 1, 21, 30, 15, 123456, tzinfo=timezone(timedelta(hours=9)))
    repo.record_worker_event(WorkerEventRecord("p-9", "tz", WorkerRole.PREFILL,
                                               WorkerState.READY, at=tokyo))
    [event] = repo.list_worker_events(worker_id="p-9")
    assert event.at == tokyo
    assert event.at is not None and event.at.utcoffset() == timedelta(0)
    assert event.at.hour == 12 and event.at.microsecond == 123456


def check_concurrent_writers(repo: Repository) -> None:
    """Services share one repository from many threads (``asyncio.to_thread``): no write is
    lost or refused."""
    num_threads, num_writes = 4, 25

    def write(thread: int) -> None:
        for i in range(num_writes):
            repo.record_worker_event(WorkerEventRecord(
                f"w-{thread}", "busy", WorkerRole.DECODE, WorkerState.READY, reason=str(i)))
            repo.record_transfer_stats([sample_transfer(f"c-{thread}-{i}", deployment="busy")])

    with ThreadPoolExecutor(max_workers=num_threads) as pool:
        list(pool.map(write, range(num_threads)))
    events = repo.list_worker_events(deployment="busy", limit=1000)
    assert len(events) == num_threads * num_writes
    assert len(repo.list_transfer_stats("busy", limit=1000)) == num_threads * num_writes
    for thread in range(num_threads):
        reasons = [e.reason for e in events if e.worker_id == f"w-{thread}"]
        assert sorted(reasons, key=int) == [str(i) for i in range(num_writes)]
