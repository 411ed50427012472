from __future__ import annotations

from pdserve.common.types import WorkerLoad, WorkerRecord, WorkerRole, WorkerState
from pdserve.pool.lifecycle import WORKER_TRANSITIONS, is_legal
from pdserve.pool.manager import choose_drain_victims


def test_failed_and_drained_workers_never_return_to_service() -> None:
    assert not is_legal(WorkerState.FAILED, WorkerState.READY)
    assert not is_legal(WorkerState.DRAINED, WorkerState.READY)
    assert not is_legal(WorkerState.DRAINING, WorkerState.READY)
    assert is_legal(WorkerState.LOADING, WorkerState.READY)
    assert all(WorkerState.FAILED in targets for state, targets in WORKER_TRANSITIONS.items()
               if state is not WorkerState.FAILED)


def _record(worker_id: str, state: WorkerState, running: int = 0, queued: int = 0) -> WorkerRecord:
    return WorkerRecord(worker_id, "m", WorkerRole.DECODE, state, "addr",
                        load=WorkerLoad(num_queued_prefill_tokens=queued, num_running_seqs=running))


def test_drain_victims_are_unready_first_then_least_loaded() -> None:
    live = [
        _record("busy", WorkerState.READY, running=50),
        _record("idle", WorkerState.READY, running=1),
        _record("loading", WorkerState.LOADING),
    ]
    assert [r.worker_id for r in choose_drain_victims(live, 2)] == ["loading", "idle"]
    assert choose_drain_victims(live, 0) == []
