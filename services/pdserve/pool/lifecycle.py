"""Worker lifecycle rules, pure.

REGISTERING -> LOADING -> READY -> DRAINING -> DRAINED, and FAILED from anywhere when
heartbeats stop. A worker reports its own state; the pool accepts only moves in this table, so a
late heartbeat can never move a FAILED or DRAINED worker back into service (it must re-register).
"""

from __future__ import annotations

from pdserve.common.types import WorkerState

WORKER_TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.REGISTERING: frozenset(
        {
            WorkerState.LOADING,
            WorkerState.READY,
            WorkerState.DRAINING,
            WorkerState.DRAINED,
            WorkerState.FAILED,
        }
    ),
    WorkerState.LOADING: frozenset(
        {WorkerState.READY, WorkerState.DRAINING, WorkerState.DRAINED, WorkerState.FAILED}
    ),
    WorkerState.READY: frozenset({WorkerState.DRAINING, WorkerState.FAILED}),
    WorkerState.DRAINING: frozenset({WorkerState.DRAINED, WorkerState.FAILED}),
    WorkerState.DRAINED: frozenset({WorkerState.FAILED}),
    WorkerState.FAILED: frozenset(),
}


def is_legal(current: WorkerState, new: WorkerState) -> bool:
    return new is current or new in WORKER_TRANSITIONS[current]


def is_routable(state: WorkerState) -> bool:
    return state is WorkerState.READY
