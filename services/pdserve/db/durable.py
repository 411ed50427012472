"""Durable records written off the serving path, through a spool on local disk.

Services hand records to a ``DurableWriter``; one background thread takes them in batches and
writes them to the repository in order. A batch whose write fails (the database is down or
behind), and everything after it until the database takes writes again, is appended to this
process's spool file first (one JSON line a record, fsync'd per batch), and the spool is
truncated once everything in it is in the database. Serving never waits for Postgres: while it
is down the records wait on disk, and they are written, in order, when it returns. With the
database up nothing touches the disk: a write-ahead spool would cost two fsyncs per batch (a
tenth of the coordinator's CPU under load, in py-spy) to cover only the batch being written,
which a ``kill -9`` mid-write loses, like the records still lingering in the queue.

Nothing is lost when the process dies (even ``kill -9``) after a record was spooled: every
writer holds an exclusive ``flock`` on its own file, and any writer on the same spool folder
adopts the files nobody holds any more (at start and then periodically), copies their records
into its own spool and writes them. Spool folders are per database (a hash of its URL), so a
record only ever goes to the database it was meant for.

A record can be written twice (written, then the process died before the spool was
truncated), so every write is idempotent: transfer statistics are keyed by their fencing token,
request windows by (deployment, window start, length, source), and worker events and scaling
decisions by their natural key with the time they were made (``skip_if_recorded``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import fcntl
import hashlib
import json
import logging
import os
import queue
import socket
import tempfile
import threading
import time
import types
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from pdserve.common.errors import AlreadyExistsError, InvalidArgumentError
from pdserve.common.metrics import gauge
from pdserve.common.types import TransferRecord, WorkerRecord, WorkerState
from pdserve.db.engine import is_sqlite_memory, make_engine
from pdserve.db.records import (
    RequestWindowRecord,
    ScalingDecisionRecord,
    TransferStatsRecord,
    WorkerEventRecord,
)
from pdserve.db.repository import Repository

logger = logging.getLogger(__name__)

SPOOL_SUFFIX = ".spool"
MAX_SPOOL_BYTES = 1 << 30
"""A spool file that grows beyond this (a database gone for days) drops new records, counted."""
ADOPT_INTERVAL_S = 30.0
"""How often a writer looks for spools of dead processes to adopt."""
MAX_BATCH = 500
MAX_BACKOFF_S = 5.0
BATCH_LINGER_S = 0.0
"""After the first record of a batch, how long the writer may collect more before it spools and
writes them (one fsync and one INSERT for all of them instead of one per record, which under load
took a fifth of a coordinator's CPU). Off by default: a record waiting out the linger is in no
spool yet, and a SIGKILL then loses it (tests/e2e/test_faults_postgres.py caught one of 241 with
50 ms). A writer whose records may be lost on a crash can pass ``linger_s``."""


# -- record codec -------------------------------------------------------------------------------


class RecordKind(enum.StrEnum):
    WORKER_EVENT = "worker_event"
    TRANSFER_STATS = "transfer_stats"
    REQUEST_WINDOW = "request_window"
    SCALING_DECISION = "scaling_decision"


_RECORD_CLASSES: dict[RecordKind, type] = {
    RecordKind.WORKER_EVENT: WorkerEventRecord,
    RecordKind.TRANSFER_STATS: TransferStatsRecord,
    RecordKind.REQUEST_WINDOW: RequestWindowRecord,
    RecordKind.SCALING_DECISION: ScalingDecisionRecord,
}


def _encode_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {k: _encode_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode_value(v) for v in value]
    return value


def _decoder_for(hint: Any) -> Callable[[Any], Any]:
    """How to turn the JSON value of a field with type ``hint`` back into the field's value."""
    target = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        target = next(a for a in typing.get_args(hint) if a is not type(None))
    if target is datetime:
        return lambda v: None if v is None else datetime.fromisoformat(v)
    if isinstance(target, type) and issubclass(target, enum.Enum):
        return lambda v: None if v is None else target(v)
    return lambda v: v


_DECODERS: dict[RecordKind, dict[str, Callable[[Any], Any]]] = {
    kind: {name: _decoder_for(hint) for name, hint in typing.get_type_hints(cls).items()}
    for kind, cls in _RECORD_CLASSES.items()
}


def encode_record(kind: RecordKind, record: Any) -> bytes:
    """One spool line (UTF-8 JSON and a newline)."""
    fields = {f.name: _encode_value(getattr(record, f.name)) for f in dataclasses.fields(record)}
    return json.dumps({"kind": kind.value, "record": fields}, separators=(",", ":"),
                      allow_nan=False).encode() + b"\n"


def decode_record(line: bytes) -> tuple[RecordKind, Any]:
    """The (kind, record) of a spool line; ``ValueError`` for a malformed one."""
    try:
        data = json.loads(line)
        kind = RecordKind(data["kind"])
        decoders = _DECODERS[kind]
        values = {name: decoders[name](value) for name, value in data["record"].items()
                  if name in decoders}
        return kind, _RECORD_CLASSES[kind](**values)
    except (KeyError, TypeError, InvalidArgumentError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed spool line: {exc}") from None


# -- spool file ---------------------------------------------------------------------------------


def spool_folder(base: Path | None, database_url: str) -> Path:
    """The folder of spools for ``database_url`` under ``base`` (default: the temp folder)."""
    root = base if base is not None else Path(tempfile.gettempdir()) / "pdserve-spool"
    digest = hashlib.sha256(database_url.encode()).hexdigest()[:16]
    return root / digest


SPOOL_BYTES = gauge("durable", "spool", "bytes",
                    "Records written to this process's spool file while the database was away, "
                    "not yet replayed; growing for long = the database stays unreachable.",
                    ["service"])


class Spool:
    """This process's append-only spool file, held under an exclusive ``flock``."""

    def __init__(self, folder: Path, name: str = "pdserve") -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:40]
        self.path = folder / (f"{safe}-{socket.gethostname()[:32]}-{os.getpid()}-"
                              f"{uuid.uuid4().hex[:8]}{SPOOL_SUFFIX}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._gauge = SPOOL_BYTES.labels(name)
        self.num_bytes = 0

    def append(self, lines: list[bytes]) -> None:
        """Append and fsync (one system call for the whole batch, then one fsync)."""
        data = b"".join(lines)
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        os.fsync(self._fd)
        self.num_bytes += len(data)
        self._gauge.set(self.num_bytes)

    def truncate(self) -> None:
        if self.num_bytes:
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            self.num_bytes = 0
            self._gauge.set(0)

    def close(self) -> None:
        """Release the file: removed when empty, else left for the next writer to adopt."""
        if self._fd < 0:
            return
        if self.num_bytes == 0:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)
        self._fd = -1

    def adopt_orphans(self) -> list[bytes]:
        """Lines of every spool in the folder that no live process holds, oldest file first;
        each adopted file is removed (its lines must then be appended to this spool). A torn
        last line (the owner died while writing it, before its fsync) is skipped."""
        adopted: list[bytes] = []
        paths = sorted((p for p in self.folder.glob(f"*{SPOOL_SUFFIX}") if p != self.path),
                       key=lambda p: _mtime(p))
        for path in paths:
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue  # adopted by someone else meanwhile
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its process is alive
                try:
                    if os.stat(path).st_ino != os.fstat(fd).st_ino:
                        continue  # adopted and removed by another writer before we locked it
                except FileNotFoundError:
                    continue
                with os.fdopen(os.dup(fd), "rb") as file:
                    data = file.read()
                lines = data.split(b"\n")
                if lines and lines[-1]:
                    logger.warning("spool %s: skipping a torn last record", path.name)
                complete = [line + b"\n" for line in lines[:-1] if line.strip()]
                if complete:
                    logger.info("adopting %d spooled durable records from %s", len(complete),
                                path.name)
                adopted.extend(complete)
                path.unlink()
            finally:
                os.close(fd)
        return adopted


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


# -- writer -------------------------------------------------------------------------------------


_STOP = object()


def _resolve_all(futures: list[tuple[asyncio.Future[bool], bool]]) -> None:
    for future, is_spooled in futures:
        if not future.done():
            future.set_result(is_spooled)


class DurableWriter:
    """Write, or spool then write, durable records; see the module docstring.

    ``spool`` None keeps the records in memory only (a bounded queue; what is not written when
    the process ends is lost): for in-memory databases and tests.
    """

    def __init__(self, repository: Repository, spool: Spool | None = None,
                 max_queue: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 linger_s: float = BATCH_LINGER_S) -> None:
        self.repository = repository
        self.spool = spool
        self._clock = clock
        self._linger_s = linger_s
        self._queue: queue.Queue[Any] = queue.Queue(max_queue)
        self._pending: collections.deque[tuple[RecordKind, Any]] = collections.deque()
        self._cond = threading.Condition()
        self._spooled_waiters: list[tuple[int, asyncio.AbstractEventLoop,
                                          asyncio.Future[bool]]] = []
        """(target, loop, future) of ``spooled_async`` callers, woken by the thread."""
        self.num_submitted = 0
        self.num_taken = 0
        """Records the thread has taken from the queue (pending, written, spooled)."""
        self.num_spooled = 0
        """Records that are safe from this process's death: on disk or in the database (with
        no spool: taken)."""
        self._num_unspooled = 0
        """The newest pending records that are in memory only (written ahead of the spool)."""
        self.num_written = 0
        self.num_dropped = 0
        self.num_adopted = 0
        self.num_rejected = 0
        """Records the database refused as malformed (logged, not retried)."""
        self._is_database_down = False
        self._is_ending = False
        if spool is not None:
            self._adopt()  # before anything of ours: adopted records are older
        self._thread = threading.Thread(target=self._run, name="durable-writer", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------

    def submit_record(self, kind: RecordKind, record: Any) -> None:
        """Queue one record; never blocks (a full queue drops the record, counted)."""
        try:
            self._queue.put_nowait((kind, record))
        except queue.Full:
            self.num_dropped += 1
            return
        with self._cond:
            self.num_submitted += 1

    def wait_spooled(self, timeout_s: float = 10.0) -> bool:
        """Until every record submitted so far is written or, its write failed, on disk; True
        if so."""
        with self._cond:
            target = self.num_submitted
            return self._cond.wait_for(
                lambda: self._is_spooled(target) or not self._thread.is_alive(), timeout_s,
            ) and self._is_spooled(target)

    async def spooled_async(self, timeout_s: float = 10.0) -> bool:
        """``wait_spooled`` for a coroutine, without a thread of its own: the writer thread
        wakes the caller's loop once (``call_soon_threadsafe``) when the records are safe."""
        loop = asyncio.get_running_loop()
        with self._cond:
            target = self.num_submitted
            if self._is_spooled(target):
                return True
            if self._is_ending or not self._thread.is_alive():
                return False
            future: asyncio.Future[bool] = loop.create_future()
            self._spooled_waiters.append((target, loop, future))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            return False
        finally:
            if not future.done() or future.cancelled():  # timed out, or the caller cancelled
                with self._cond:
                    self._spooled_waiters = [w for w in self._spooled_waiters
                                             if w[2] is not future]

    def _is_spooled(self, target: int) -> bool:
        return self.num_spooled + self.num_dropped >= target

    def _notify_locked(self) -> None:
        """Wake the threads in ``wait_*`` and the coroutines in ``spooled_async`` whose records
        are now safe (all of them, with False, once the thread has ended). Under ``_cond``."""
        self._cond.notify_all()
        if not self._spooled_waiters:
            return
        woken: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[bool], bool]]] = {}
        kept = []
        for target, loop, future in self._spooled_waiters:
            if self._is_spooled(target) or self._is_ending:
                woken.setdefault(loop, []).append((future, self._is_spooled(target)))
            else:
                kept.append((target, loop, future))
        self._spooled_waiters = kept
        for loop, futures in woken.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve_all, futures)

    def wait_written(self, timeout_s: float = 10.0) -> bool:
        """Until nothing submitted so far waits for the database; True if so."""
        with self._cond:
            target = self.num_submitted
            return self._cond.wait_for(
                lambda: (self.num_taken + self.num_dropped >= target and not self._pending)
                or not self._thread.is_alive(), timeout_s) and not self._pending

    @property
    def num_pending(self) -> int:
        """Records spooled and not yet in the database."""
        return len(self._pending)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: spool what is queued, write what the database takes within ``timeout_s``;
        the rest stays in the spool for the next writer on this folder."""
        with contextlib.suppress(queue.Full):
            self._queue.put((_STOP, self._clock() + timeout_s), timeout=timeout_s)
        self._thread.join(timeout_s + 2.0)
        if self.spool is not None and not self._thread.is_alive():
            self.spool.close()
        self.repository.close()

    # -- sinks --------------------------------------------------------------------------------

    def record_worker_event(
        self, worker: WorkerRecord, from_state: WorkerState | None, reason: str
    ) -> None:
        self.submit_record(RecordKind.WORKER_EVENT, WorkerEventRecord(
            worker_id=worker.worker_id, deployment=worker.deployment, role=worker.role,
            to_state=worker.state, from_state=from_state, reason=reason[:500],
            at=datetime.now(UTC)))

    def record_transfer(self, record: TransferRecord) -> None:
        ticket = record.ticket
        self.submit_record(RecordKind.TRANSFER_STATS, TransferStatsRecord(
            ticket_id=ticket.token.ticket_id, attempt=ticket.token.attempt,
            deployment=ticket.deployment, prefill_worker_id=ticket.prefill_worker_id,
            decode_worker_id=ticket.decode_worker_id, num_blocks=ticket.num_blocks,
            num_bytes=record.num_bytes, transfer_s=record.transfer_s, exposed_s=record.exposed_s,
            prefill_compute_s=record.prefill_compute_s, outcome=record.outcome,
            at=datetime.now(UTC)))

    def record_request_window(self, record: RequestWindowRecord) -> None:
        self.submit_record(RecordKind.REQUEST_WINDOW, record)

    def record_scaling_decision(self, record: ScalingDecisionRecord) -> None:
        """A decision keeps its time (stamped here when None): it is part of its write key."""
        if record.at is None:
            record = dataclasses.replace(record, at=datetime.now(UTC))
        self.submit_record(RecordKind.SCALING_DECISION, record)

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._run_batches()
        finally:
            with self._cond:
                self._is_ending = True
                self._notify_locked()

    def _run_batches(self) -> None:
        backoff_s = 0.1
        next_attempt = 0.0
        next_adoption = self._clock() + ADOPT_INTERVAL_S
        stop_by: float | None = None
        while True:
            now = self._clock()
            if self.spool is not None and now >= next_adoption and stop_by is None:
                self._adopt()
                next_adoption = now + ADOPT_INTERVAL_S
            wait_s: float | None
            if self._pending and now < next_attempt:
                wait_s = next_attempt - now
            elif self._pending:
                wait_s = 0.0
            else:
                wait_s = max(0.0, next_adoption - now) if self.spool is not None else None
            items, stop = self._take(wait_s if stop_by is None else 0.0)
            if stop is not None:
                stop_by = stop
            self._spool(items)
            if self._pending and self._clock() >= next_attempt:
                if self._write_batch():
                    backoff_s = 0.1
                    next_attempt = 0.0
                else:
                    next_attempt = self._clock() + backoff_s
                    backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)
            if not self._pending and self.spool is not None:
                self.spool.truncate()
            if stop_by is not None and (not self._pending or self._clock() >= stop_by) \
                    and self._queue.empty():
                return
            if stop_by is not None and self._pending and next_attempt > self._clock():
                time.sleep(min(0.05, max(0.0, stop_by - self._clock())))

    def _take(self, wait_s: float | None) -> tuple[list[tuple[RecordKind, Any]], float | None]:
        """Whatever is queued (waiting up to ``wait_s`` for the first; None = forever)."""
        items: list[tuple[RecordKind, Any]] = []
        stop: float | None = None
        try:
            item = self._queue.get(timeout=wait_s) if wait_s != 0.0 else self._queue.get_nowait()
        except queue.Empty:
            return items, None
        linger_until = time.monotonic() + self._linger_s
        while True:
            if isinstance(item, tuple) and item and item[0] is _STOP:
                stop = item[1]
            else:
                items.append(item)
            if len(items) >= MAX_BATCH * 4:
                break
            remaining_s = linger_until - time.monotonic() if stop is None else 0.0
            try:
                item = (self._queue.get(timeout=remaining_s) if remaining_s > 0
                        else self._queue.get_nowait())
            except queue.Empty:
                break
        return items, stop

    def _spool(self, items: list[tuple[RecordKind, Any]]) -> None:
        """Take ``items`` into the pending records: on disk first while the database is down,
        else in memory until their write (``_spool_unspooled`` if it fails)."""
        if not items:
            return
        if self.spool is not None and not self._is_database_down:
            with self._cond:
                self._pending.extend(items)
                self._num_unspooled += len(items)
                self.num_taken += len(items)
                self._notify_locked()
            return
        if self.spool is not None:
            items = self._append_to_spool(items)
        with self._cond:
            self._pending.extend(items)
            self.num_taken += len(items)
            self.num_spooled += len(items)
            self._notify_locked()

    def _spool_unspooled(self) -> None:
        """A write failed: the pending records still in memory only go on disk now."""
        if self.spool is None or not self._num_unspooled:
            return
        with self._cond:
            tail = list(self._pending)[len(self._pending) - self._num_unspooled:]
        kept = self._append_to_spool(tail)
        with self._cond:
            if len(kept) != len(tail):  # the spool was full: the rest is dropped (counted)
                kept_ids = {id(item) for item in kept}
                dropped_ids = {id(item) for item in tail if id(item) not in kept_ids}
                self._pending = collections.deque(
                    item for item in self._pending if id(item) not in dropped_ids)
            self._num_unspooled = 0
            self.num_spooled += len(kept)
            self._notify_locked()

    def _append_to_spool(self, items: list[tuple[RecordKind, Any]]
                         ) -> list[tuple[RecordKind, Any]]:
        """Append ``items`` to the spool file; returns those kept (a full spool drops the
        rest, counted). An append that fails keeps them in memory all the same (logged)."""
        assert self.spool is not None
        lines = []
        kept = []
        for kind, record in items:
            line = encode_record(kind, record)
            if self.spool.num_bytes + len(line) > MAX_SPOOL_BYTES:
                self.num_dropped += 1
                continue
            lines.append(line)
            kept.append((kind, record))
        try:
            self.spool.append(lines)
        except OSError:
            logger.exception("could not append to the spool %s; keeping %d records in memory",
                             self.spool.path, len(kept))
        return kept

    def _adopt(self) -> None:
        assert self.spool is not None
        try:
            lines = self.spool.adopt_orphans()
        except OSError:
            logger.exception("could not adopt orphaned spools in %s", self.spool.folder)
            return
        if not lines:
            return
        records = []
        for line in lines:
            try:
                records.append(decode_record(line))
            except ValueError as exc:
                logger.warning("dropping a spooled record: %s", exc)
        self.spool.append([encode_record(k, r) for k, r in records])
        with self._cond:
            self._pending.extendleft(reversed(records))  # older than anything of ours
            self.num_adopted += len(records)
            self._notify_locked()

    def _write_batch(self) -> bool:
        """Write the oldest pending records (consecutive transfer statistics together); False
        if the database is unavailable (retry later)."""
        kind, record = self._pending[0]
        batch = [record]
        if kind is RecordKind.TRANSFER_STATS:
            for other_kind, other in list(self._pending)[1:MAX_BATCH]:
                if other_kind is not RecordKind.TRANSFER_STATS:
                    break
                batch.append(other)
        try:
            self._write(kind, batch)
        except (AlreadyExistsError, InvalidArgumentError, ValueError, TypeError) as exc:
            if not isinstance(exc, AlreadyExistsError):
                self.num_rejected += len(batch)
                logger.error("durable store refused a %s record, dropped: %s", kind, exc)
        except Exception as exc:  # noqa: BLE001 - down or behind: keep it and retry
            if not self._is_database_down:
                logger.warning("durable store unavailable (%s); %d records wait in the spool",
                               exc, len(self._pending))
            self._is_database_down = True
            self._spool_unspooled()
            return False
        if self._is_database_down:
            logger.info("durable store is back; writing %d spooled records", len(self._pending))
            self._is_database_down = False
        with self._cond:
            # The batch is the oldest pending; those of it in memory only are done with too.
            done_unspooled = max(0, len(batch) - (len(self._pending) - self._num_unspooled))
            for _ in batch:
                self._pending.popleft()
            self._num_unspooled -= done_unspooled
            self.num_spooled += done_unspooled
            self.num_written += len(batch)
            self._notify_locked()
        return True

    def _write(self, kind: RecordKind, batch: list[Any]) -> None:
        repository = self.repository
        if kind is RecordKind.TRANSFER_STATS:
            repository.record_transfer_stats(batch)
        elif kind is RecordKind.WORKER_EVENT:
            repository.record_worker_event(batch[0], skip_if_recorded=True)
        elif kind is RecordKind.REQUEST_WINDOW:
            repository.record_request_window(batch[0])
        elif kind is RecordKind.SCALING_DECISION:
            repository.record_scaling_decision(batch[0], skip_if_recorded=True)
        else:  # pragma: no cover - RecordKind is closed
            raise ValueError(kind)


def open_writer(repository: Repository, database_url: str, spool_dir: Path | None,
                name: str) -> DurableWriter:
    """A writer with a spool for ``database_url`` under ``spool_dir`` (an in-memory SQLite
    database gets none: nobody else could write its records)."""
    if is_sqlite_memory(make_url(database_url)):
        return DurableWriter(repository)
    return DurableWriter(repository, Spool(spool_folder(spool_dir, database_url), name))


def open_durable(database_url: str, spool_dir: Path | None, name: str, *,
                 migrate: bool) -> DurableWriter | None:
    """The durable writer of a service process, or None (with a warning) when the database
    cannot be used: serving never depends on the durable store. ``migrate`` upgrades the
    schema first (the one-machine stack; a fleet runs ``pdserve db upgrade`` as a job)."""
    from pdserve.db.migrate import upgrade

    try:
        # No ping before each batch (a query per checkout, ~5% of a loaded coordinator's CPU):
        # a batch that meets a dead connection fails, is spooled and written again, and the
        # failure invalidates the pool's connections.
        repository = Repository(make_engine(database_url, pool_pre_ping=False))
        if migrate:
            upgrade(repository.engine)
        return open_writer(repository, database_url, spool_dir, name)
    except Exception as exc:  # noqa: BLE001 - serving does not depend on the durable store
        logger.warning("durable store unavailable (%s): decisions and outcomes are not recorded",
                       exc)
        return None


# -- adapters -----------------------------------------------------------------------------------


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

    async def spooled(self, timeout_s: float = 2.0) -> None:
        """Until the records so far are in the spool (or written): the coordinator acknowledges
        a DONE only then, so a SIGKILL right after loses no statistics it acknowledged. Off the
        token path (workers report DONE in the background); a writer that cannot keep up
        delays the acknowledgement by ``timeout_s`` at most."""
        await self._writer.spooled_async(timeout_s)


class WindowWriterAdapter:
    """Request windows go through the spool like every other record (the write never fails)."""

    def __init__(self, writer: DurableWriter) -> None:
        self._writer = writer

    def record_request_window(self, record: Any) -> None:
        self._writer.record_request_window(record)


def records_in(spool_lines: Iterable[bytes]) -> list[tuple[RecordKind, Any]]:
    """Decode spool lines (tests and tools)."""
    return [decode_record(line) for line in spool_lines if line.strip()]
