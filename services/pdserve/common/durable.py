"""Durable records written off the serving path.

Services hand records to a ``DurableWriter``; one background thread writes them to the
repository in order, retrying with backoff while the database is down. Serving never waits for
Postgres. The queue is bounded: when it is full the oldest record is dropped and counted (a
spool to local disk that survives a crash is the reliability issue's job).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pdserve.db.records import TransferStatsRecord, WorkerEventRecord
from pdserve.db.repository import Repository
from pdserve.kv_transfer.coordinator import TransferRecord
from pdserve.state.types import WorkerRecord, WorkerState

logger = logging.getLogger(__name__)


class DurableWriter:
    def __init__(self, repository: Repository, max_queue: int = 100_000) -> None:
        self.repository = repository
        self._queue: queue.Queue[tuple[Callable[..., Any], Any] | None] = queue.Queue(max_queue)
        self.num_dropped = 0
        self.num_written = 0
        self._thread = threading.Thread(target=self._run, name="durable-writer", daemon=True)
        self._thread.start()

    def submit(self, method: Callable[..., Any], record: Any) -> None:
        try:
            self._queue.put_nowait((method, record))
        except queue.Full:
            self.num_dropped += 1

    def _run(self) -> None:
        backoff_s = 0.1
        while True:
            item = self._queue.get()
            if item is None:
                return
            method, record = item
            while True:
                try:
                    method(record)
                    self.num_written += 1
                    backoff_s = 0.1
                    break
                except Exception:  # noqa: BLE001 - database down: wait and retry
                    logger.warning("durable write failed; retrying in %.1fs", backoff_s, exc_info=True)
                    time.sleep(backoff_s)
                    backoff_s = min(5.0, backoff_s * 2)

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self.repository.close()

    # -- sinks --------------------------------------------------------------------------------

    def record_worker_event(self, worker: WorkerRecord, from_state: WorkerState | None, reason: str) -> None:
        self.submit(self.repository.record_worker_event, WorkerEventRecord(
            worker_id=worker.worker_id, deployment=worker.deployment, role=worker.role,
            to_state=worker.state, from_state=from_state, reason=reason[:500],
            at=datetime.now(UTC)))

    def record_transfer(self, record: TransferRecord) -> None:
        ticket = record.ticket
        self.submit(self.repository.record_transfer_stats, [TransferStatsRecord(
            ticket_id=ticket.token.ticket_id, attempt=ticket.token.attempt,
            deployment=ticket.deployment, prefill_worker_id=ticket.prefill_worker_id,
            decode_worker_id=ticket.decode_worker_id, num_blocks=ticket.num_blocks,
            num_bytes=record.num_bytes, transfer_s=record.transfer_s, exposed_s=record.exposed_s,
            prefill_compute_s=record.prefill_compute_s, outcome=record.outcome,
            at=datetime.now(UTC))])


class LifecycleSinkAdapter:
    def __init__(self, writer: DurableWriter) -> None:
        self._writer = writer

    def record(self, worker: WorkerRecord, from_state: WorkerState | None, reason: str) -> None:
        self._writer.record_worker_event(worker, from_state, reason)


class TransferSinkAdapter:
    def __init__(self, writer: DurableWriter) -> None:
        self._writer = writer

    def record(self, record: TransferRecord) -> None:
        self._writer.record_transfer(record)


class WindowWriterAdapter:
    """Request windows go straight to the repository (the aggregator already retries)."""

    def __init__(self, writer: DurableWriter) -> None:
        self._writer = writer

    def record_request_window(self, record: Any) -> None:
        self._writer.submit(self._writer.repository.record_request_window, record)
