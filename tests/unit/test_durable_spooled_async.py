"""``DurableWriter.spooled_async``: a coroutine waits until the records submitted before it are
safe (written, or on disk), woken by the writer thread, with no thread of its own; it gives up
after its timeout and answers False once the writer has stopped."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from pdserve.common.types import TicketState
from pdserve.db import upgrade
from pdserve.db.durable import DurableWriter, RecordKind, Spool
from pdserve.db.engine import make_engine
from pdserve.db.records import TransferStatsRecord
from pdserve.db.repository import Repository

pytestmark = pytest.mark.timeout(60)


class GatedRepository(Repository):
    """Transfer statistics are written only once ``gate`` is set (a slow database)."""

    def __init__(self, path: Path) -> None:
        engine = make_engine(f"sqlite:///{path}")
        upgrade(engine)
        super().__init__(engine)
        self.gate = threading.Event()

    def record_transfer_stats(self, batch: Iterable[TransferStatsRecord]) -> int:
        self.gate.wait()
        return super().record_transfer_stats(batch)


def _stats(i: int) -> TransferStatsRecord:
    return TransferStatsRecord(ticket_id=f"t{i}", attempt=1, deployment="d",
                               prefill_worker_id="p-1", decode_worker_id="d-1", num_blocks=4,
                               num_bytes=1000, transfer_s=0.01, exposed_s=0.001,
                               prefill_compute_s=0.02, outcome=TicketState.DONE)


@pytest.fixture
def gated(tmp_path: Path) -> Iterator[tuple[DurableWriter, GatedRepository]]:
    repository = GatedRepository(tmp_path / "pdserve.db")
    writer = DurableWriter(repository, Spool(tmp_path / "spool", "test"))
    try:
        yield writer, repository
    finally:
        repository.gate.set()
        writer.close()


def test_it_waits_for_the_write_and_gives_up_at_its_timeout(
        gated: tuple[DurableWriter, GatedRepository]) -> None:
    writer, repository = gated

    async def scenario() -> None:
        writer.submit_record(RecordKind.TRANSFER_STATS, _stats(1))
        # The database has not taken it and it is on no disk: not safe yet.
        assert not await writer.spooled_async(0.2)
        assert writer.num_spooled == 0
        waiting = asyncio.ensure_future(writer.spooled_async(10.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        repository.gate.set()
        assert await waiting
        assert writer.num_written == 1

    asyncio.run(scenario())
    assert not writer._spooled_waiters, "a waiter that timed out is forgotten"  # noqa: SLF001


def test_records_submitted_after_the_call_are_not_waited_for(
        gated: tuple[DurableWriter, GatedRepository]) -> None:
    writer, repository = gated
    repository.gate.set()

    async def scenario() -> None:
        writer.submit_record(RecordKind.TRANSFER_STATS, _stats(1))
        assert await writer.spooled_async(10.0)
        repository.gate.clear()
        first = asyncio.ensure_future(writer.spooled_async(10.0))  # nothing new: at once
        await asyncio.sleep(0)  # it has started, and taken its target
        writer.submit_record(RecordKind.TRANSFER_STATS, _stats(2))
        assert await first
        assert not await writer.spooled_async(0.2)  # the second waits for the gate
        repository.gate.set()
        assert await writer.spooled_async(10.0)

    asyncio.run(scenario())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_waiters_are_answered_false_when_the_thread_dies_and_later_callers_at_once(
        gated: tuple[DurableWriter, GatedRepository]) -> None:
    writer, _ = gated

    def broken(items: object) -> None:
        raise RuntimeError("the writer thread dies")

    async def scenario() -> None:
        waiting = asyncio.ensure_future(writer.spooled_async(30.0))
        await asyncio.sleep(0)
        writer._spool = broken  # type: ignore[method-assign]  # noqa: SLF001
        writer.submit_record(RecordKind.TRANSFER_STATS, _stats(1))
        later = asyncio.ensure_future(writer.spooled_async(30.0))
        assert await waiting  # nothing was submitted before it
        assert not await asyncio.wait_for(later, 5.0)
        writer._thread.join(5.0)  # noqa: SLF001
        assert not await asyncio.wait_for(writer.spooled_async(30.0), 5.0)

    asyncio.run(scenario())
