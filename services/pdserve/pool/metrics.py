"""Prometheus metrics of a pool manager, refreshed from the worker records each health pass."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pdserve.common.metrics import counter, gauge
from pdserve.common.types import ReconcileResult, WorkerRecord, WorkerRole, WorkerState

WORKERS = gauge("pool", "size", "workers", "Workers by deployment, role and state.",
                ["deployment", "role", "state"])
FREE_BLOCKS = gauge("pool", "free_kv", "blocks", "Free KV blocks a decode worker reported.",
                    ["deployment", "worker"])
QUEUED_TOKENS = gauge("pool", "queued_prefill", "tokens",
                      "Prompt tokens queued on a prefill worker.", ["deployment", "worker"])
RESERVED_BLOCKS = gauge("pool", "reserved_kv", "blocks",
                        "KV blocks the ledger holds reserved for open tickets on a decode worker.",
                        ["deployment", "worker"])
HELD_BLOCKS = gauge("pool", "held_kv", "blocks",
                    "KV blocks the ledger counts as held by running sequences on a decode worker.",
                    ["deployment", "worker"])
LEDGER_CORRECTIONS = counter(
    "pool", "ledger_corrected", "tickets",
    "Ledger entries reconciliation corrected against a decode worker's own block table: released "
    "(the worker did not know the ticket) or adopted (the ledger did not know the sequence). "
    "Steady corrections mean the ledger drifts.", ["deployment", "action"])

_seen: set[tuple[str, str, str]] = set()


def observe_ledger(deployment: str, result: ReconcileResult) -> None:
    """A decode worker's ledger after the reconciliation of one heartbeat."""
    snapshot = result.snapshot
    RESERVED_BLOCKS.labels(deployment, snapshot.worker_id).set(snapshot.num_reserved_blocks)
    HELD_BLOCKS.labels(deployment, snapshot.worker_id).set(snapshot.num_held_blocks)
    if result.released:
        LEDGER_CORRECTIONS.labels(deployment, "released").inc(len(result.released))
    if result.adopted:
        LEDGER_CORRECTIONS.labels(deployment, "adopted").inc(len(result.adopted))


def observe_pool(role: WorkerRole, records: Iterable[WorkerRecord]) -> None:
    counts: Counter[tuple[str, str, str]] = Counter()
    for record in records:
        counts[(record.deployment, str(role), str(record.state))] += 1
        if role is WorkerRole.DECODE:
            FREE_BLOCKS.labels(record.deployment, record.worker_id).set(record.load.num_free_blocks)
        else:
            QUEUED_TOKENS.labels(record.deployment, record.worker_id).set(
                record.load.num_queued_prefill_tokens)
    for deployment, role_name, _ in list(_seen) + list(counts):
        for state in WorkerState:
            key = (deployment, role_name, str(state))
            if key in counts or key in _seen:
                WORKERS.labels(*key).set(counts.get(key, 0))
                _seen.add(key)
